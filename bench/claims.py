"""BENCHMARKS.md's first table, one row per claim, kept as data and rendered by this script (issue 51 item 5).

bench/claims.json holds the rows (id, claim, host, date, conditions, command, ours, reference, ratio) in the
order the table shows them. A bench that measures a claim updates its row with `update(...)` (e.g.
`bench/real_models.py --claims`, `bench/startup.py --claims`) and re-renders; a figure measured by hand is set
with the CLI. The table between the markers in BENCHMARKS.md is never edited by hand: tests/test_claims.py
checks that it is what `render` makes of claims.json.

  python bench/claims.py render                       # rewrite BENCHMARKS.md's table from claims.json
  python bench/claims.py set ID --ours "..." --ratio "..." [--reference ...] [--command ...] [--claim ...]
                                [--conditions ...] [--date YYYY-MM-DD] [--host AMD]   # one row, then render
  python bench/claims.py host                         # this host's name as the table writes it
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
CLAIMS = os.path.join(HERE, "claims.json")
BENCHMARKS = os.path.join(os.path.dirname(HERE), "BENCHMARKS.md")
BEGIN, END = "<!-- claims: rendered by bench/claims.py from bench/claims.json; do not edit by hand -->", \
    "<!-- claims: end -->"
FIELDS = ("id", "claim", "host", "date", "conditions", "command", "ours", "reference", "ratio")
HEADER = "| claim | host, date | command | ours | reference | ratio |\n|---|---|---|---|---|---|"


def host_name(cpuinfo: str | None = None) -> str:
    """The host as the table names it: Intel (AMX), AMD (AVX512-BF16, Zen 4) or AMD AVX2; else the CPU model."""
    if cpuinfo is None:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), []))
    if "Intel" in model:
        return "Intel" if "amx_tile" in flags else f"Intel ({model})"
    if "AMD" in model:
        return "AMD" if "avx512_bf16" in flags else "AMD AVX2" if "avx2" in flags else f"AMD ({model})"
    return model


def load(path: str = CLAIMS) -> list[dict]:
    with open(path) as f:
        rows = json.load(f)
    for r in rows:
        missing = [k for k in FIELDS if k not in r]
        if missing:
            raise ValueError(f"{path}: claim {r.get('id', '?')!r} lacks {', '.join(missing)}")
    return rows


def save(rows: list[dict], path: str = CLAIMS) -> None:
    with open(path, "w") as f:
        json.dump([{k: r[k] for k in FIELDS} for r in rows], f, indent=1, ensure_ascii=False)
        f.write("\n")


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict]) -> str:
    """The table, header first; the second column is host, date[, conditions]."""
    lines = [HEADER]
    for r in rows:
        when = ", ".join(x for x in (r["host"], r["date"], r["conditions"]) if x)
        lines.append("| " + " | ".join(_cell(x) for x in (r["claim"], when, r["command"], r["ours"],
                                                          r["reference"], r["ratio"])) + " |")
    return "\n".join(lines)


def write_table(rows: list[dict], path: str = BENCHMARKS) -> None:
    """Replace the table between the markers of `path` (which must hold both, once each)."""
    with open(path) as f:
        text = f.read()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{path} needs the claims markers once each, in order")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{render(rows)}\n{END}{tail}")


def table_in(path: str = BENCHMARKS) -> str:
    with open(path) as f:
        text = f.read()
    return text.split(BEGIN)[1].split(END)[0].strip("\n")


def update(id: str, *, claims: str = CLAIMS, benchmarks: str | None = BENCHMARKS, after: str | None = None,
           **fields: str) -> dict:
    """Set claim `id`'s fields (host and date default to this host and today); a new id is appended (or placed
    after claim `after`). Re-renders `benchmarks` unless None. Returns the row."""
    bad = set(fields) - set(FIELDS)
    if bad:
        raise ValueError(f"unknown claim fields: {', '.join(sorted(bad))} (fields: {', '.join(FIELDS[1:])})")
    rows = load(claims)
    row = next((r for r in rows if r["id"] == id), None)
    if row is None:
        if "claim" not in fields:
            raise ValueError(f"claim {id!r} is new: give its claim text")
        row = {k: "" for k in FIELDS} | {"id": id}
        where = next((i + 1 for i, r in enumerate(rows) if r["id"] == after), len(rows))
        rows.insert(where, row)
    row.update({"host": host_name(), "date": datetime.date.today().isoformat(), "conditions": ""}, **fields)
    save(rows, claims)
    if benchmarks is not None:
        write_table(rows, benchmarks)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("render")
    sub.add_parser("host")
    s = sub.add_parser("set")
    s.add_argument("id")
    s.add_argument("--after")
    for k in FIELDS[1:]:
        s.add_argument(f"--{k}")
    a = ap.parse_args()
    if a.cmd == "render":
        write_table(load())
    elif a.cmd == "host":
        print(host_name())
    else:
        update(a.id, after=a.after, **{k: getattr(a, k) for k in FIELDS[1:] if getattr(a, k) is not None})


if __name__ == "__main__":
    main()
