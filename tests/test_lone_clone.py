"""The suite needs nothing beside the repository (issue 52 item 8): CI runs `make test` in a clone whose
parent may hold nothing, so no file that `make test` runs — the package, the tests, the Makefile, CI's
script and the bench scripts the tests start — may name `../shared` (the team's bench folder beside the
checkout). Bench scripts run by hand against llama-server or the real model files may; they are not
part of the suite."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = re.compile(r"\.\./shared|shared/bench")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()
    return [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT) for f in fs
            if ".venv" not in d and ".git" not in d]


def _bench_scripts_the_tests_start(files: list[str]) -> set[str]:
    named = set()
    for f in files:
        if f.startswith("tests/") and f.endswith(".py"):
            with open(os.path.join(ROOT, f)) as fh:
                text = fh.read()
            named |= {f"bench/{m}" for m in re.findall(r"bench[/\"', ]+([a-z_0-9]+\.py)", text)}
    return named | _bench_modules_they_import(named)


def _bench_modules_they_import(scripts: set[str]) -> set[str]:
    """bench/ modules the started scripts import (gpu_check imports workload.py), followed to the end."""
    seen, todo = set(), list(scripts)
    while todo:
        path = os.path.join(ROOT, todo.pop())
        if not os.path.isfile(path):
            continue
        with open(path) as fh:
            names = re.findall(r"^\s*(?:import|from)\s+([a-z_0-9]+)", fh.read(), flags=re.M)
        for f in {f"bench/{n}.py" for n in names} - seen - scripts:
            if os.path.isfile(os.path.join(ROOT, f)):
                seen.add(f)
                todo.append(f)
    return seen


def test_nothing_make_test_runs_reads_beside_the_repository():
    files = _tracked()
    suite = {f for f in files if f.startswith(("pagedserve/", "tests/")) or f in ("Makefile", ".ci/run", "pyproject.toml")}
    started = _bench_scripts_the_tests_start(files)
    assert started, "the soak and gpu_check scripts are started by tests: the scan found none"
    offenders = []
    for f in sorted(suite | started):
        path = os.path.join(ROOT, f)
        if f == "tests/test_lone_clone.py" or not os.path.isfile(path):
            continue
        with open(path, errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                if SHARED.search(line):
                    offenders.append(f"{f}:{i}: {line.strip()[:120]}")
    assert not offenders, "\n".join(offenders)
