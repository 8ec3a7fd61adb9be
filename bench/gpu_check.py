"""Issue 28's GPU check: one command on one H200 (<= 8 minutes), every figure a JSON line.

Time on an H200 per section, estimated from the first run's (stop 48: 156 s for env .. mixed64, the model written
in 17 s and loaded in 4 s): env 10 s | unit 65 s, with reference (30 s) beside it | bandwidth 2 s | decode 45 s
(writing the 8B-shaped model included; 5 row counts x 23 steps after their prefill) | mixed64 35 s (+30 s with
--profile) | traffic 80 s (two engine loads, four runs of 3 + 12 s; a window stretches, to 30 s at most, until
10 interactive requests fell in it). In all ~4 minutes (~4.5 with --profile; at most ~6 if every traffic
window stretches), inside the device tool's 10-minute command.

    make gpu-check-assets                 # here: build/gpu_check/ (wheels the GPU image lacks, mixed64.jsonl)
    python bench/gpu_check.py --out DIR   # there (the device tool: carry ["build/gpu_check"], --out $OUT)
    python bench/gpu_check.py --cpu-smoke # here: every section at toy sizes on the CPU (Triton's interpreter)

Sections, in order (the unit tests in a child process beside the reference section); each one's failure is
recorded and the next still runs:
  env        the GPU, torch / triton / transformers versions; wheels from build/gpu_check/wheels installed
             into a private folder where the image lacks them (pytest and its dependencies, gguf)
  unit       pytest tests/model/test_triton_attention.py on CUDA tensors (the kernels compiled, not
             interpreted) and the engine steps in it (the Triton path vs torch, CUDA graphs vs eager)
  reference  random models of four families written by transformers: float32 greedy through the engine
             on the GPU against HF's (vLLM's near-tie rule), bfloat16 against float32 (the closeness rule:
             equal tokens, or at the first difference each token in the other's top-5); eager steps (the unit
             section compares graphs with eager)
  bandwidth  decode attention over 64 sequences x 4,096 positions (Llama-3-8B's KV heads, bf16): bytes of
             K/V read per second, next to a device-to-device copy's (read + written bytes per second)
  decode     (bench/gpu_decode.py) decode steps of mixed64's Llama-3-8B-shaped model at 1 / 8 / 32 / 64 / 128
             rows, 512 tokens of context, against the weight-read roofline (weight + KV bytes per step / a copy's
             bandwidth measured here): the step's ratio to it and the host's share of the step (the step less the
             forward's CUDA-event time)
  mixed64    a Llama-3-8B-shaped random model in bf16 (--layers of them): the shared mixed64 workload through
             pagedserve (CUDA graphs on) and through HF transformers' continuous batching on the same GPU,
             output tok/s and their ratio; each of our steps traced (`pagedserve simulate --calibrate-from`
             reads the file) and compared with the simulator's h200 profile (median |predicted / measured - 1|)
  traffic    (bench/gpu_traffic.py) an interactive streaming class beside a batch class flooding with long prompts
             at priority 10, against the interactive stream alone and the batch class alone (and priorities only)

Aims (issue 28): mixed64 >= 3x HF continuous batching; decode attention >= 60 % of the copy bandwidth; the
h200 profile within 20 % of the measured step times. Issue 53: a decode step at 64 rows <= 1.5x its roofline.
Issue 54 (26's): with classes, interactive ITL p99 <= 1.5x idle, TTFT p99 <= 2x idle, batch >= 80 % of alone.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "build", "gpu_check")
# wheel name prefix -> the module it provides
WHEELS = {"pytest": "pytest", "pluggy": "pluggy", "iniconfig": "iniconfig", "pygments": "pygments",
          "pytest_timeout": "pytest_timeout", "packaging": "packaging", "gguf": "gguf"}
FAMILIES = ["llama", "qwen3", "gemma2", "mistral"]
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


class Report:
    def __init__(self, out: str):
        os.makedirs(out, exist_ok=True)
        self.out = out
        self.file = open(os.path.join(out, "gpu_check.jsonl"), "a", buffering=1)

    def __call__(self, section: str, **fields) -> None:
        line = json.dumps({"section": section, **fields}, default=str)
        print(line, flush=True)
        self.file.write(line + "\n")


def section(report: Report, name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        fields = fn(*args) or {}
        report(name, ok=fields.pop("ok", True), seconds=round(time.perf_counter() - t0, 1), **fields)
    except Exception as e:      # recorded; the next section still runs
        report(name, ok=False, seconds=round(time.perf_counter() - t0, 1), error=f"{type(e).__name__}: {e}",
               trace=traceback.format_exc()[-3000:])
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------- env

def install_missing_wheels(target: str) -> list[str]:
    """The wheels in build/gpu_check/wheels whose module this Python lacks, installed (no index, no
    dependencies) into `target`, which goes first on sys.path and PYTHONPATH."""
    folder = os.path.join(ASSETS, "wheels")
    if not os.path.isdir(folder):
        return []
    missing = [w for w in sorted(os.listdir(folder)) if w.endswith(".whl")
               and importlib.util.find_spec(WHEELS.get(w.split("-")[0].lower(), w.split("-")[0])) is None]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                        target] + [os.path.join(folder, w) for w in missing], check=True)
        sys.path.insert(0, target)
        os.environ["PYTHONPATH"] = os.pathsep.join([target, ROOT] + [p for p in
                                                   [os.environ.get("PYTHONPATH")] if p])
        importlib.invalidate_caches()
    return missing


def env(target: str, device: str) -> dict:
    installed = install_missing_wheels(target)
    import torch
    import transformers
    import triton
    out = dict(installed_wheels=installed, python=sys.version.split()[0], torch=torch.__version__,
               triton=triton.__version__, transformers=transformers.__version__, device=device)
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out |= dict(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return out


# ---------------------------------------------------------------------------------------------- unit

def start_unit() -> subprocess.Popen:
    """The unit tests in a child process, started before the reference section, which runs beside them (both
    only check results, and the machine has cores to spare for Triton's compiles); the timed sections wait."""
    # the sm_90 compile test is for machines without a GPU: here every kernel compiles for real
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-o", "addopts=",
           "tests/model/test_triton_attention.py", "-k", "not compiles_for_an_h200"]
    envv = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.Popen(cmd, cwd=ROOT, env=envv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def unit(child: subprocess.Popen, smoke: bool) -> dict:
    try:
        out, _ = child.communicate(timeout=300 if not smoke else 600)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
    tail = out.strip().splitlines()[-40:]
    return dict(ok=child.returncode == 0, rc=child.returncode, summary=tail[-1] if tail else "", tail=tail)


# ---------------------------------------------------------------------------------------------- reference

def reference(device: str, workdir: str) -> dict:
    import torch
    sys.path.insert(0, ROOT)
    from pagedserve import LLM, SamplingParams
    from tests.model.families import save_family, tiny_tokenizer
    from tests.model.helpers import assert_greedy_match, hf_greedy
    tok, n_tokens = tiny_tokenizer(512), 16
    results, ok = {}, True
    for name in FAMILIES:
        d = os.path.join(workdir, f"ref-{name}")
        hf = save_family(name, d, len(tok), tok, sharpen=5.0)
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 90)]
        params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
        runs = {}
        for dtype in ("float32", "bfloat16"):
            with LLM(d, dtype=dtype, device=device, num_kv_blocks=64, block_size=16, enforce_eager=True) as llm:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                runs[dtype] = [(list(o.outputs[0].token_ids), [set(lp) for lp in o.outputs[0].logprobs])
                               for o in outs]
                backend = llm.engine.core.runner.attention_backend
        fam = {"attention": backend}
        try:
            for p, (got, _) in zip(prompts, runs["float32"]):
                assert_greedy_match(got, *hf_greedy(hf, p, n_tokens), tol=1e-4)
            fam["float32_vs_hf"] = "match"
        except AssertionError as e:
            fam["float32_vs_hf"], ok = f"MISMATCH {e}", False
        close = True
        for (ta, la), (tb, lb) in zip(runs["float32"], runs["bfloat16"]):
            i = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
            if i is not None and not (ta[i] in lb[i] and tb[i] in la[i]):
                close = False
        fam["bfloat16_vs_float32"] = "close" if close else "NOT CLOSE"
        fam["bfloat16_equal_tokens"] = sum(a == b for (a, _), (b, _) in zip(runs["float32"], runs["bfloat16"]))
        ok &= close
        results[name] = fam
    return dict(ok=ok, families=results)


# ---------------------------------------------------------------------------------------------- bandwidth

def bandwidth(device: str, smoke: bool) -> dict:
    import torch
    from pagedserve.kernels import triton_attention as ta
    from pagedserve.model.attention import LayerKV
    B, ctx, n_kv, G, hd, bs = (64, 4096, 8, 4, 128, 16) if not smoke else (2, 40, 2, 2, 32, 16)
    per_seq = -(-ctx // bs)
    nb = B * per_seq + 1
    kv = LayerKV(torch.randn(nb, bs, n_kv, hd, device=device, dtype=torch.bfloat16),
                 torch.randn(nb, bs, n_kv, hd, device=device, dtype=torch.bfloat16))
    tables = (torch.randperm(nb - 1, device=device)[: B * per_seq] + 1).view(B, per_seq)
    lens = torch.full((B,), ctx, device=device, dtype=torch.long)
    q = torch.randn(B, n_kv * G, hd, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = hd ** -0.5

    def attention():
        ta.decode_attention(q, kv, tables, lens, scale, max_context=ctx, out=out)

    kv_bytes = 2 * B * ctx * n_kv * hd * 2
    t_attn, copy_bw = _time(attention, device, 3 if smoke else 50), copy_bandwidth(kv_bytes, device, smoke)
    attn_bw, t_copy = kv_bytes / t_attn, 2 * kv_bytes / copy_bw
    # prefill, for tuning (no aim): the first 8 sequences' last `chunk` positions as chunks, causal over ctx
    P, chunk = (8, 512) if not smoke else (2, 8)
    cu = torch.arange(P + 1, device=device) * chunk
    qp = torch.randn(P * chunk, n_kv * G, hd, device=device, dtype=torch.bfloat16)
    t_pre = _time(lambda: ta.prefill_attention(qp, kv, tables[:P], cu, lens[:P], scale, max_q=chunk), device,
                  3 if smoke else 20)
    flops = 4 * hd * n_kv * G * P * sum(ctx - chunk + i + 1 for i in range(chunk))     # QK^T and PV, causal
    return dict(shape=dict(seqs=B, context=ctx, kv_heads=n_kv, group=G, head_dim=hd, block_size=bs),
                kv_bytes=kv_bytes, attention_ms=round(t_attn * 1e3, 4), copy_ms=round(t_copy * 1e3, 4),
                attention_gb_s=round(attn_bw / 1e9, 1), copy_gb_s=round(copy_bw / 1e9, 1),
                share_of_copy=round(attn_bw / copy_bw, 3), aim=">= 0.6",
                prefill=dict(chunks=P, chunk=chunk, context=ctx, ms=round(t_pre * 1e3, 3),
                             tflop_s=round(flops / t_pre / 1e12, 2)))


def copy_bandwidth(nbytes: int, device: str, smoke: bool) -> float:
    """Bytes per second a device-to-device copy of `nbytes` reaches (read + written bytes)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time(lambda: dst.copy_(src), device, 3 if smoke else 50)


def _time(fn, device: str, iters: int) -> float:
    import torch
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


# ---------------------------------------------------------------------------------------------- mixed64

def big_model(workdir: str, layers: int, device: str, smoke: bool) -> tuple[str, float]:
    """The Llama-3-8B-shaped model's folder, written by the first section that needs it: (folder, seconds spent
    writing it here, 0 when an earlier section did)."""
    d = os.path.join(workdir, "llama3-8b-shaped")
    done = os.path.join(d, ".written")         # not config.json: a write that failed half way is not reused
    if os.path.exists(done):
        return d, 0.0
    t0 = time.perf_counter()
    make_big_model(d, layers, device, smoke)
    open(done, "w").close()
    return d, time.perf_counter() - t0


def make_big_model(d: str, layers: int, device: str, smoke: bool) -> None:
    import torch
    import transformers
    from tests.model.families import tiny_tokenizer
    fields = LLAMA3_8B | dict(num_hidden_layers=layers)
    if smoke:
        fields |= dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=49152)
    cfg = transformers.LlamaConfig(**fields)
    with torch.device(device):
        try:
            model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
        except TypeError:                   # transformers 4: torch_dtype
            model = transformers.LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(d, safe_serialization=True)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(d)
    del model


def read_workload(smoke: bool) -> list[dict]:
    path = os.path.join(ASSETS, "mixed64.jsonl")
    if not os.path.exists(path):            # here: the generator in bench/ (a copy of the shared one)
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import workload
        reqs = workload.make("mixed64")
    else:
        reqs = [json.loads(line) for line in open(path)]
    if smoke:
        reqs = [dict(r, prompt_token_ids=r["prompt_token_ids"][:48], max_tokens=min(r["max_tokens"], 8))
                for r in reqs[:6]]
    return reqs


def _run_pass(eng, reqs, tag: str, on_step=None) -> tuple[float, bool]:
    """The workload through the engine once: (wall seconds, every request got its tokens)."""
    import torch
    from pagedserve.sampling_params import SamplingParams
    if eng.core.runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(f"{tag}-{r['id']}", r["prompt_token_ids"],
                        SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = len(o.outputs[0].token_ids)
        if on_step is not None and eng.core.last_schedule is not None and eng.core.last_schedule.seqs:
            on_step(eng)
    wall = time.perf_counter() - t0
    return wall, all(done.get(f"{tag}-{r['id']}") == r["max_tokens"] for r in reqs)


def _triton_kernels() -> int:
    """Compiled kernels in Triton's cache folder (a new one during serving is a compile in a step)."""
    d = os.environ.get("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    return len(os.listdir(d)) if os.path.isdir(d) else 0


def ours(d: str, reqs: list[dict], device: str, trace_path: str, out: str, profile: bool) -> dict:
    """Three passes of the workload through one engine: the first traced (and compared with the h200 profile),
    the second warm (every kernel compiled), with --profile a third with the sampler's earlier path (every
    row's logits to the host) and a fourth under torch.profiler, then each decode graph replayed alone."""
    import torch
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.sim.calibrate import StepTrace
    from pagedserve.sim.cost_model import PROFILES, RooflineCost, shape_of_engine, step_features
    t0 = time.perf_counter()
    eng = LLMEngine(EngineArgs(model=d, dtype="bfloat16", device=device, max_num_seqs=64,
                               max_num_batched_tokens=2048, gpu_memory_utilization=0.85))
    load_s = time.perf_counter() - t0
    eng.add_request("warm-up", list(range(100, 164)), SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    trace, shape = StepTrace(trace_path), shape_of_engine(eng.core)
    h200 = RooflineCost(shape, PROFILES["h200"])
    steps, kernels = [], [_triton_kernels()]

    def on_step(e):
        f = step_features(shape, e.core.last_schedule.seqs)
        st = e.core.last_stats
        n = _triton_kernels()
        steps.append(dict(step_ms=st.step_s * 1e3, predicted_ms=h200.step_time(f) * 1e3,
                          decodes=sum(1 for s in e.core.last_schedule.seqs if s.is_decode),
                          prefill_tokens=e.core.last_schedule.num_prefill_tokens, prepare_ms=st.prepare_s * 1e3,
                          forward_ms=st.forward_s * 1e3, sample_ms=st.sample_s * 1e3, compiled=n - kernels[-1]))
        kernels.append(n)
        trace.record(e)

    wall, ok = _run_pass(eng, reqs, "cold", on_step)
    warm, ok2 = _run_pass(eng, reqs, "warm")
    out_tokens = sum(r["max_tokens"] for r in reqs)
    errs = [abs(s["predicted_ms"] / s["step_ms"] - 1) for s in steps if s["step_ms"] > 0]
    decode_only = [abs(s["predicted_ms"] / s["step_ms"] - 1) for s in steps if s["step_ms"] > 0 and not
                   s["prefill_tokens"]]
    med = lambda xs: round(statistics.median(xs), 3) if xs else None       # noqa: E731
    res = dict(load_s=round(load_s, 1), wall_s=round(wall, 2), output_tokens=out_tokens,
               output_tok_s=round(out_tokens / wall, 1), warm_wall_s=round(warm, 2),
               warm_output_tok_s=round(out_tokens / warm, 1), token_counts_ok=ok and ok2, steps=len(steps),
               compiles_during_first_pass=sum(s["compiled"] for s in steps),
               steps_over_300ms=[(i, round(s["step_ms"]), s["compiled"]) for i, s in enumerate(steps)
                                 if s["step_ms"] > 300],
               attention=eng.core.runner.attention_backend, graphs=eng.core.runner.graphs_note,
               h200_profile_median_rel_error=med(errs), h200_profile_decode_only_median_rel_error=med(decode_only),
               step_ms_p50=med([s["step_ms"] for s in steps]), trace=trace_path)
    try:                    # the h200 profile refitted to this trace (bench/fit_gpu_profile.py)
        from bench.fit_gpu_profile import fit as fit_profile
        from pagedserve.sim.calibrate import read_trace
        res["h200_profile_refit"] = fit_profile(shape, PROFILES["h200"], read_trace(trace_path, shape))
    except Exception as e:
        res["h200_profile_refit"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, "steps.jsonl"), "w") as f:
        for s in steps:
            f.write(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}) + "\n")
    if profile:
        res |= _profile(eng, reqs, out, out_tokens)
    eng.shutdown()
    del eng
    return res


def _profile(eng, reqs, out: str, out_tokens: int) -> dict:
    import torch
    from pagedserve.runner.sampler import Sampler
    res = {}
    sampler = eng.core.runner.sampler
    try:         # A/B in this run: the sampler's earlier path, every row's logits copied to the host
        sampler.sample_on_device = lambda logits, *a, **k: Sampler.__call__(sampler, logits.cpu(), *a, **k)
        wall, _ = _run_pass(eng, reqs, "host-sampling")
        res["host_sampling_output_tok_s"] = round(out_tokens / wall, 1)
    finally:
        del sampler.sample_on_device
    counter, first = [0], 12 if len(reqs) > 16 else 2       # the smoke run's passes have ~8 steps

    def on_step(e):
        counter[0] += 1
        if counter[0] == first:
            prof.__enter__()
        elif counter[0] == first + 4:
            if cuda:
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
    cuda = eng.core.runner.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts)
    _run_pass(eng, reqs, "profiled", on_step)
    ka = prof.key_averages()
    with open(os.path.join(out, "profile_decode_steps.txt"), "w") as f:
        f.write("4 decode steps of ~60 rows (steps 12-15 of a warm pass)\n\n")
        if cuda:
            f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    g = eng.core.runner.graphs
    if g is not None:
        replay = {}
        for b in g.sizes:
            replay[b] = round(_time(g.graphs[b].replay, "cuda", 20) * 1e3, 3)
        res["graph_replay_ms"] = replay
    return res


def mixed64(device: str, workdir: str, out: str, layers: int, smoke: bool, profile: bool = False) -> dict:
    sys.path.insert(0, ROOT)
    d, made_s = big_model(workdir, layers, device, smoke)
    reqs = read_workload(smoke)
    a = ours(d, reqs, device, os.path.join(out, "step_trace.jsonl"), out, profile)
    Report(out)("mixed64-pagedserve", **a)        # written before the baseline's long run
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()
        a["cuda_allocated_gib_after"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    try:
        from bench.families_bench import run_hf          # HF transformers' continuous batching, as there
        b = run_hf(d, reqs, "bfloat16", device)
    except Exception as e:
        b = dict(error=f"{type(e).__name__}: {e}")
    ratio = a["output_tok_s"] / b["output_tok_s"] if b.get("output_tok_s") else None
    return dict(ok=a["token_counts_ok"] and b.get("token_counts_ok", False), model_layers=layers,
                model_write_s=round(made_s, 1), requests=len(reqs), pagedserve=a, hf_cb=b,
                ratio=round(ratio, 2) if ratio else None, aim=">= 3x HF continuous batching")


# ---------------------------------------------------------------------------------------------- decode, traffic

def decode(device: str, workdir: str, layers: int, smoke: bool) -> dict:
    """Issue 53 item 5: bench/gpu_decode.py against the bandwidth of a 1-GiB copy measured here."""
    sys.path.insert(0, ROOT)
    from bench import gpu_decode
    d, made_s = big_model(workdir, layers, device, smoke)
    bw = copy_bandwidth(2**30 if not smoke else 2**20, device, smoke)
    return dict(model_layers=layers, model_write_s=round(made_s, 1), **gpu_decode.run(d, device, smoke, bw))


def traffic(device: str, workdir: str, layers: int, smoke: bool) -> dict:
    """Issue 54 item 6: bench/gpu_traffic.py's four runs."""
    sys.path.insert(0, ROOT)
    from bench import gpu_traffic
    d, made_s = big_model(workdir, layers, device, smoke)
    return dict(model_layers=layers, model_write_s=round(made_s, 1), **gpu_traffic.run(d, device, smoke))


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_check"))
    ap.add_argument("--layers", type=int, default=32, help="the Llama-3-8B-shaped model's layers (8B: 32)")
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: the script itself checked")
    ap.add_argument("--sections", default="env,unit,reference,bandwidth,decode,mixed64,traffic")
    ap.add_argument("--profile", action="store_true", help="mixed64: also the sampler A/B, torch.profiler over "
                    "4 decode steps (profile_decode_steps.txt) and each decode graph replayed alone")
    ns = ap.parse_args()
    if ns.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report = Report(ns.out)
    device = "cpu" if ns.cpu_smoke else "cuda"
    wanted = ns.sections.split(",")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        t0 = time.perf_counter()
        if "env" in wanted:
            section(report, "env", env, os.path.join(work, "site"), device)
        child = start_unit() if "unit" in wanted else None
        if "reference" in wanted:
            section(report, "reference", reference, device, work)
        if child is not None:
            section(report, "unit", unit, child, ns.cpu_smoke)
        if "bandwidth" in wanted:
            section(report, "bandwidth", bandwidth, device, ns.cpu_smoke)
        layers = 2 if ns.cpu_smoke else ns.layers
        if "decode" in wanted:
            section(report, "decode", decode, device, work, layers, ns.cpu_smoke)
        if "mixed64" in wanted:
            section(report, "mixed64", mixed64, device, work, ns.out, layers, ns.cpu_smoke, ns.profile)
        if "traffic" in wanted:
            section(report, "traffic", traffic, device, work, layers, ns.cpu_smoke)
        report("done", seconds=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
