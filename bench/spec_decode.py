"""Speculative decoding (n-gram prompt lookup or a draft model), one stream: output tokens/s with and without it on an
input-grounded workload (repeat, rewrite and extract from a given passage, a code edit), the same
over a long retrieved context (`long`: quoting ~1,300 tokens of minutes) and a free-form chat
workload, greedy, each request alone (one stream), in one run (ratios); acceptance rate, draft tokens
and whether the greedy outputs are identical to decoding without drafts.

Each configuration runs in its own process (its own start-up, the adaptive rule's measured step
costs); with --paired, an off configuration and those after it up to the next off share one process
(each engine its own start-up and measured costs, the weights shared), prompt by prompt in turn: on
this kind of host one process's speed differs from another's by up to ~15 %, more than the ratios
measured need. A configuration is DTYPE:QUANT[:SPEC[:seeded]], SPEC one of off | adaptive | always (n-gram,
k = --k) | draft | draft-always (method draft_model with --draft: a model path, or a number N for the
bundled model's first N layers written by bench/truncated_draft.py into a temporary folder).
--temperature T > 0 samples instead (top-p 0.95): unseeded requests get a draft model's proposals
sampled from its distribution and verified by full rejection sampling; `seeded` gives each request a
seed, so a draft model proposes its argmax (and the outputs must equal those without drafts).

Usage: python bench/spec_decode.py [--configs auto:auto:off,auto:auto:adaptive,...] [--tokens 128]
           [--k 4] [--workloads grounded,chat] [--draft 8] [--temperature 0] [--paired] [--json out.json]
"""
import argparse
import json
import os
import subprocess
import sys
import time

PASSAGE = (
    "The committee met on Tuesday to review the budget for the new library. After two hours of discussion, "
    "members agreed to fund the children's reading room, postpone the rooftop garden until next spring, "
    "and ask the city for a second grant to cover the cost of accessible entrances. The chair thanked the "
    "volunteers who had counted every book in the old building and promised a public meeting in March.")
CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config has no name")
    if "version" not in data:
        raise ValueError("config has no version")
    return data
'''
GROUNDED = [
    f"Repeat the following passage exactly, word for word.\n\n{PASSAGE}",
    f"Rewrite the following passage in the past perfect tense, keeping every detail.\n\n{PASSAGE}",
    f"From the passage below, list every decision the committee made, quoting the passage.\n\n{PASSAGE}",
    f"Rename the function load_config to read_config in this code and return the whole file.\n\n{CODE}",
    f"Add a check that raises ValueError(\"config has no owner\") when \"owner\" is missing, and return the "
    f"whole function.\n\n{CODE}",
]
TOWNS = ["Alder", "Birch", "Cedar", "Dunmore", "Elm", "Fairview", "Glen", "Harbor", "Ivy", "Juniper", "Kestrel",
         "Linden", "Maple", "Northgate", "Oakridge", "Pinecrest"]
MINUTES = "\n\n".join(
    f"Item {i + 1}. The council of {t} met on day {3 + 2 * i} of the month to discuss the {w} budget. The treasurer "
    f"reported a balance of {1200 + 137 * i} dollars and asked for {40 + 9 * i} volunteers for the {w} fair. "
    f"Members voted {5 + i % 4} to {i % 3} to repair the {('bridge', 'school roof', 'water tower', 'library')[i % 4]} "
    f"and to plant {20 + 3 * i} trees along {t} Road before the first frost."
    for i, (t, w) in enumerate(zip(TOWNS, ["spring", "summer", "autumn", "winter"] * 4)))
LONG = [        # a retrieved context of ~1,300 tokens, and answers that quote it
    f"{MINUTES}\n\nRepeat item 7 above exactly, word for word.",
    f"{MINUTES}\n\nCopy items 12 and 13 above exactly.",
    f"{MINUTES}\n\nWhat did the council of Linden decide? Quote the minutes.",
    f"{MINUTES}\n\nRewrite item 3 above in the future tense, keeping every number.",
    f"{MINUTES}\n\nRepeat the last item above exactly.",
]
CHAT = [
    "Tell me a long story about a dragon.",
    "Explain how a refrigerator works to a curious ten-year-old.",
    "What are three good habits for writing readable Python code? Explain each.",
    "Write a short poem about autumn rain.",
    "Describe the water cycle in a few paragraphs.",
]
WORKLOADS = {"grounded": GROUNDED, "long": LONG, "chat": CHAT}


def prompt_ids(texts):
    from pagedserve.model.loader import resolve_model
    from pagedserve.tokenizer import apply_chat_template, load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    return [apply_chat_template(tok, [{"role": "user", "content": t}]) for t in texts]


def draft_path(draft: str) -> str:
    """--draft: a path, or layers of the bundled model (N: the first N; 0-7,24-29; 0-29/2), written once."""
    if os.path.exists(draft):
        return draft
    import tempfile
    from truncated_draft import parse_layers, truncate_gguf
    from pagedserve.model.loader import default_model_path
    path = os.path.join(tempfile.gettempdir(), "pagedserve-drafts", f"smollm2-{draft.replace('/', 'by')}.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        truncate_gguf(default_model_path(), path + ".part", parse_layers(draft))
        os.replace(path + ".part", path)
    return path


def make_llm(config: str, k: int, draft: str | None = None, draft_quant: str | None = None):
    from pagedserve import LLM, SamplingParams
    dtype, quant, spec, seeded = (config.split(":") + ["off", ""])[:4]
    if spec.startswith("draft"):
        sc = {"model": draft_path(draft), "num_speculative_tokens": k, "adaptive": spec == "draft",
              "quantization": draft_quant}
    else:
        sc = None if spec == "off" else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                                         "adaptive": spec == "adaptive"}
    t0 = time.perf_counter()
    llm = LLM(num_kv_blocks=512, dtype=dtype, quantization=quant, speculative_config=sc)
    load_s = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": prompt_ids(["Hi"])[0]}], SamplingParams(max_tokens=8), use_tqdm=False)
    return llm, seeded == "seeded", load_s


def run(configs: list[str], tokens: int, k: int, workloads: list[str], draft: str | None = None,
        draft_quant: str | None = None, temperature: float = 0.0) -> list[dict]:
    """The configs in one process, prompt by prompt in turn (each request alone): their ratios free of
    what differs between processes."""
    from pagedserve import SamplingParams
    llms = [make_llm(c, k, draft, draft_quant) for c in configs]

    def sp(i: int, seeded: bool) -> SamplingParams:
        if temperature <= 0:
            return SamplingParams(max_tokens=tokens, temperature=0.0)
        return SamplingParams(max_tokens=tokens, temperature=temperature, top_p=0.95,
                              seed=1000 + i if seeded else None)
    outs = [{"config": c, "load_s": round(load_s, 2), "workloads": {}} for c, (_, _, load_s) in zip(configs, llms)]
    for w in workloads:
        acc = [{"tokens": 0, "secs": 0.0, "outputs": [], "d0": llm.engine.core.scheduler.spec_stats.num_draft_tokens,
                "a0": llm.engine.core.scheduler.spec_stats.num_accepted_tokens} for llm, _, _ in llms]
        for i, ids in enumerate(prompt_ids(WORKLOADS[w])):
            for (llm, seeded, _), a in zip(llms, acc):
                t = time.perf_counter()
                o = llm.generate([{"prompt_token_ids": ids}], sp(i, seeded), use_tqdm=False)[0].outputs[0]
                a["secs"] += time.perf_counter() - t
                a["tokens"] += len(o.token_ids)
                a["outputs"].append(o.token_ids)
        for (llm, _, _), a, out in zip(llms, acc, outs):
            stats = llm.engine.core.scheduler.spec_stats
            drafted, accepted = stats.num_draft_tokens - a["d0"], stats.num_accepted_tokens - a["a0"]
            out["workloads"][w] = {"tok_s": round(a["tokens"] / a["secs"], 2), "tokens": a["tokens"],
                                   "seconds": round(a["secs"], 2), "draft_tokens": drafted, "accepted": accepted,
                                   "acceptance": round(accepted / drafted, 3) if drafted else None,
                                   "outputs": a["outputs"]}
    return outs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="auto:auto:off,auto:auto:adaptive,float32:none:off,float32:none:adaptive")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--workloads", default="grounded,chat")
    ap.add_argument("--json", default=None)
    ap.add_argument("--draft", default="8", help="draft model for SPEC draft | draft-always: a path or N layers")
    ap.add_argument("--draft-quantization", default=None, help="the draft's speculative_config quantization")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--child", default=None)
    ap.add_argument("--paired", action="store_true",
                    help="each round's configs in one process, prompt by prompt in turn (rounds: off restarts one)")
    a = ap.parse_args()
    workloads = a.workloads.split(",")
    if a.child:
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
        print("RESULT " + json.dumps(run(a.child.split("+"), a.tokens, a.k, workloads, a.draft, a.draft_quantization,
                                         a.temperature)), flush=True)
        return
    from pagedserve.host import describe
    print(f"host: {describe()}")
    results = []
    configs = a.configs.split(",")
    if a.paired:            # a round: an off config and the ones after it up to the next off
        rounds, cur = [], []
        for c in configs:
            if (c.split(":") + ["off"])[2] == "off" and cur:
                rounds.append(cur)
                cur = []
            cur.append(c)
        configs = ["+".join(r) for r in rounds + [cur]]
    for c in configs:
        p = subprocess.run([sys.executable, __file__, "--child", c, "--tokens", str(a.tokens), "--k", str(a.k),
                            "--workloads", a.workloads, "--draft", a.draft, "--temperature", str(a.temperature)]
                           + (["--draft-quantization", a.draft_quantization] if a.draft_quantization else []),
                           capture_output=True, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(p.stdout[-2000:], p.stderr[-4000:])
            raise SystemExit(f"{c} failed")
        results.extend(json.loads(line[0][7:]))
    def key(config: str) -> str:                 # the off run it is compared with: DTYPE:QUANT and seededness
        parts = config.split(":")
        return ":".join(parts[:2]) + (":seeded" if parts[3:4] == ["seeded"] else "")
    def off_before(i: int, config: str, w: str):   # the off run of its round: the last one before it, else the first
        offs = [j for j, r in enumerate(results) if (r["config"].split(":") + ["off"])[2] == "off"
                and key(r["config"]) == key(config)]
        j = max((j for j in offs if j <= i), default=offs[0] if offs else None)
        return None if j is None else results[j]["workloads"].get(w)
    print(f"{'config':28} {'workload':9} {'tok/s':>7} {'vs off':>7} {'drafted':>8} {'accept':>7} identical")
    for i, r in enumerate(results):
        for w, m in r["workloads"].items():
            b = off_before(i, r["config"], w)
            ratio = f"{m['tok_s'] / b['tok_s']:.2f}x" if b else "-"
            n_same = sum(x == y for x, y in zip(m["outputs"], b["outputs"])) if b else 0
            same = "-" if not b or b is m else f"{n_same}/{len(b['outputs'])}"
            acc = "-" if m["acceptance"] is None else f"{m['acceptance']:.2f}"
            print(f"{r['config']:28} {w:9} {m['tok_s']:7.2f} {ratio:>7} {m['draft_tokens']:8d} {acc:>7} {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"host": describe(), "date": time.strftime("%Y-%m-%d"), "tokens": a.tokens, "k": a.k,
                       "temperature": a.temperature,
                       "draft": a.draft, "draft_quantization": a.draft_quantization, "results": results}, f)


if __name__ == "__main__":
    main()
