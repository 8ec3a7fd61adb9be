"""guidellm (unmodified, from its own venv) against `pagedserve serve` and llama.cpp's `llama-server` on
the same GGUF file, one after the other in one run: C concurrent streams of synthetic prompts (256
tokens in, 128 out by default), a fixed number of requests. Prints output tok/s and inter-token latency
p50 / p99 per server, and the ratio.

Usage: python bench/guidellm_side_by_side.py --guidellm /tmp/gl/bin/guidellm [--streams 1] [--requests 8]
           [--model FILE.gguf]  (default: the bundled SmolLM2-135M file; a real file: ../shared/bench/real_models.sh)
           [--claim ID --claim-text "..."]  (write the ratio into BENCHMARKS.md's table: bench/claims.py)
           [--serve-args "--quantization gguf"] [--llama-server build/llama.cpp/bin/llama-server]
       --variants 'A;B' runs pagedserve once per `serve` flag set (A/B in one run, e.g. without and with
       '--speculative-config {"method":"ngram"}'); --no-llama-server skips llama.cpp's server.
guidellm's own venv: python3 -m venv /tmp/gl && /tmp/gl/bin/pip install torch==2.13.0 && /tmp/gl/bin/pip install
guidellm==0.8.1 (torch's CPU wheel first: guidellm alone pulls a CUDA build of torch, ~6 GB).
"""
import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server_proc import serve  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(binary: str, model: str, streams: int):
    port = free_port()
    threads = str(os.cpu_count())
    proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(streams),
                             "-c", str(1024 * streams), "-t", threads, "-tb", threads, "--cache-ram", "0", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy")


def run_guidellm(exe: str, base: str, model: str, tokdir: str, a) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={base},model={model}",
           "--profile", f"kind=concurrent,streams={a.streams}",
           "--data", f"kind=synthetic_text,prompt_tokens={a.prompt_tokens},output_tokens={a.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokdir}",
           "--constraint", f"kind=max_requests,count={a.requests}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive", "--disable-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"guidellm failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def summary(report: dict) -> dict:
    """output tok/s, ITL p50/p99 (ms), successful / errored requests of the report's one benchmark."""
    b = report["benchmarks"][0]
    m = b["metrics"]

    def stat(name, key):
        v = m[name]["successful"]
        return v["percentiles"][key] if key.startswith("p") else v[key]
    totals = m["request_totals"] if "request_totals" in m else {}
    return {"output_tok_s": round(stat("output_tokens_per_second", "mean"), 2),
            "itl_p50_ms": round(stat("inter_token_latency_ms", "p50"), 2),
            "itl_p99_ms": round(stat("inter_token_latency_ms", "p99"), 2),
            "ttft_p50_ms": round(stat("time_to_first_token_ms", "p50"), 1),
            "ok": totals.get("successful"), "errored": totals.get("errored")}


def _without_claims(argv: list[str]) -> list[str]:
    """The command line as a reader reruns it: --claim and --claim-text (and their values) left out."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in ("--claim", "--claim-text"):
            skip = True
        elif not x.startswith(("--claim=", "--claim-text=")):
            out.append(x)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--guidellm", default=os.environ.get("GUIDELLM", "guidellm"))
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="more `pagedserve serve` flags")
    ap.add_argument("--variants", default=None, help="';'-separated `serve` flag sets, one pagedserve run each")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--model", default=None, help="a GGUF file served by both (default: the bundled model)")
    ap.add_argument("--claim", default=None, help="claims.json row to update with pagedserve vs llama-server")
    ap.add_argument("--claim-text", default=None, help="the row's claim text (needed for a new row)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "build/llama.cpp/bin/llama-server"))
    a = ap.parse_args()
    from pagedserve.host import describe
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import load_tokenizer
    src = resolve_model(a.model)
    tokdir = tempfile.mkdtemp()
    load_tokenizer(src).save_pretrained(tokdir)
    print(f"host: {describe()}; guidellm {a.streams} stream(s), {a.requests} requests, "
          f"{a.prompt_tokens} -> {a.output_tokens} tokens")
    rows = []
    for flags in (a.variants.split(";") if a.variants else [a.serve_args]):
        srv, base = serve(shlex.split(flags) + ["--max-num-seqs", str(max(16, a.streams))]
                          + ([] if a.model is None else [src.path]))
        try:
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            rows.append((f"pagedserve serve {flags}".strip(), summary(run_guidellm(a.guidellm, base, model, tokdir, a))))
        finally:
            srv.send_signal(signal.SIGINT)
            srv.wait(timeout=60)
    if os.path.isfile(a.llama_server) and not a.no_llama_server:
        proc, base = start_llama_server(a.llama_server, src.path, a.streams)
        try:
            rows.append((f"llama-server -np {a.streams} --cache-ram 0",
                         summary(run_guidellm(a.guidellm, base, "default", tokdir, a))))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    for name, r in rows:
        print("RESULT " + json.dumps({"server": name, **r}))
    print("\n| server | output tok/s | ITL p50 ms | ITL p99 ms | TTFT p50 ms | ok / errored |\n|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['output_tok_s']} | {r['itl_p50_ms']} | {r['itl_p99_ms']} | {r['ttft_p50_ms']} | "
              f"{r['ok']} / {r['errored']} |")
    for name, r in rows[1:]:
        print(f"\nratio {name} / {rows[0][0]}: output tok/s {r['output_tok_s'] / rows[0][1]['output_tok_s']:.2f}x, "
              f"ITL p50 {r['itl_p50_ms'] / rows[0][1]['itl_p50_ms']:.2f}x")
    if a.claim and len(rows) == 2:
        import claims
        ours, llama = rows[0][1], rows[1][1]
        claims.update(a.claim, **({"claim": a.claim_text} if a.claim_text else {}),
                      command="`python bench/guidellm_side_by_side.py " + shlex.join(_without_claims(sys.argv[1:])) + "`",
                      ours=f"{ours['output_tok_s']} out tok/s, ITL p50 {ours['itl_p50_ms']} ms ({ours['ok']} ok)",
                      reference=f"llama-server {llama['output_tok_s']}, ITL p50 {llama['itl_p50_ms']} ms",
                      ratio=f"**{ours['output_tok_s'] / llama['output_tok_s']:.2f}x** tok/s, ITL p50 "
                            f"{ours['itl_p50_ms'] / llama['itl_p50_ms']:.2f}x")


if __name__ == "__main__":
    main()
