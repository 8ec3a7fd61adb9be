"""Host work per engine step, with the device taken out (issue 53): the real scheduler, KV-cache manager,
runner input path (ModelRunner.prepare), sampler and output path (detokenization, stop strings, stream
deltas) around a fake model whose forward takes a set time T and returns hidden states of the right shape,
whose LM head returns fixed logits over the real vocabulary. On a GPU the host's work is the speed (the
first H200 run: 41 ms decode steps at 63 rows where the weights' roofline is ~4 ms); on the CPU a real
forward hides it, so nothing measured it.

For each running count N (every request streaming, in decode, EOS ignored), K steps are timed: the
wall time of LLMEngine.step() minus T is the host's work; the core's own split (schedule + update,
prepare, sample) comes from its StepStats, the output path is what step() adds to the core's step.
The greedy argmax over the vocabulary (a device's work, done by this host inside `sample`) is timed in the
same steps and taken out of the step's figure (`step` below is without it; the split's `sample` with it). Per sequence: the slope between the smallest and largest
N. With T > 0, `rows/s of rows/T` says how much of the device's time the host loses (no overlap yet: the
host's work adds to T).

--prompt-len sets each request's context (default 32 tokens): the block tables a step used to send whole
grow with it (the KV pool is mapped but never written: the fake forward writes no keys).

--engine-process: also through the process seam (engine/core_proc.py), the fake device installed in the core's
process: the core steps by itself, so a step there is the interval between StepOutputs the frontend takes
(`--steps` of them, after every request is in decode): the slower of the core's step and the frontend's
output path, which now run beside each other, in two interpreters.

Usage: python bench/host_overhead.py [--running 1,16,64,256] [--T-ms 0,5] [--steps 30] [--sampling greedy|top_p]
                                     [--prompt-len 32] [--engine-process]
"""
import argparse
import functools
import time

import torch


def fake_device(model, t_s: float, vocab: int):
    """The model's forward and LM head replaced: forward takes t_s (a device busy that long, the host
    free: asleep but for the last millisecond, which is spun to end on time) and returns zeros; the LM head returns rows of fixed random logits (each row's argmax fixed)."""
    hidden = model.cfg.hidden_size
    dtype = model.norm.dtype
    base = [torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))]
    zeros = [torch.zeros(1, hidden, dtype=dtype)]          # the forward's output buffer, as a device's

    def forward(input_ids, positions, kv_caches, md, *_, **__):      # (lora, max_position, embeds: unused)
        if t_s:                          # asleep for most of it (the host is free), then to the microsecond
            end = time.perf_counter() + t_s
            time.sleep(max(0.0, t_s - 1e-3))
            while time.perf_counter() < end:
                pass
        n = input_ids.shape[0]
        if zeros[0].shape[0] < n:
            zeros[0] = torch.zeros(n, hidden, dtype=dtype)
        return zeros[0][:n]

    def compute_logits(h, prompt=False):
        """Rows of a table made once (a device's LM head writes its output buffer; a fresh 50 MB tensor each
        step, as this returned before, put the host's page faults into the host's time)."""
        n = h.shape[0]
        if base[0].shape[0] < n:
            base[0] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
        return base[0][:n]
    model.forward, model.compute_logits = forward, compute_logits


def install_fake(t_s: float, core) -> None:
    """ProcClient's setup (module level: it crosses to the core's process by name)."""
    fake_device(core.model, t_s, core.model.cfg.vocab_size)


def measure_seam(eng, n: int, steps: int, sampling, prompt_len: int = 32) -> dict:
    """Through the process seam: the interval between the StepOutputs the frontend takes, all n in decode."""
    from pagedserve import SamplingParams
    sp = SamplingParams(max_tokens=2_000, ignore_eos=True, **sampling)
    for i in range(n):
        eng.add_request(f"r{n}-{i}", {"prompt_token_ids": [100 + (i * 7 + j) % 40000 for j in range(prompt_len)]}, sp,
                        stream=True)
    seen: set[str] = set()
    while len(seen) < n or eng.last_step().num_decode_tokens != n:
        seen.update(o.request_id for o in eng.step())
    for _ in range(3):
        while not eng.step():
            pass
    taken, t0 = 0, time.perf_counter()
    while taken < steps:
        if eng.step():
            assert eng.last_step().num_decode_tokens == n
            taken += 1
    wall = time.perf_counter() - t0
    for rid in list(eng.states):
        eng.abort(rid)
    return {"running": n, "step_ms_p50": 1e3 * wall / steps}


def measure(eng, n: int, steps: int, sampling, prompt_len: int = 32) -> dict:
    from pagedserve import SamplingParams
    sp = SamplingParams(max_tokens=2_000, ignore_eos=True, **sampling)
    for i in range(n):
        eng.add_request(f"r{n}-{i}", {"prompt_token_ids": [100 + (i * 7 + j) % 40000 for j in range(prompt_len)]}, sp,
                        stream=True)
    while eng.core.scheduler.waiting or any(not s.is_decode for s in (eng.core.last_schedule.seqs
                                                                       if eng.core.last_schedule else [])):
        eng.step()
    for _ in range(3):
        eng.step()                                   # every request in decode, allocators warm
    wall, split = [], {"schedule+update": 0.0, "prepare": 0.0, "forward": 0.0, "sample": 0.0, "output": 0.0}
    vocab = []
    for _ in range(steps):
        with VocabMath() as vm:
            t0 = time.perf_counter()
            eng.step()
            w = time.perf_counter() - t0
        vocab.append(vm.s)
        st = eng.core.last_stats
        assert st.num_decode_tokens == n and st.num_prefill_tokens == 0, (st.num_decode_tokens, n)
        wall.append(w - vm.s)           # the step less its argmax over the vocabulary
        split["prepare"] += st.prepare_s
        split["forward"] += st.forward_s
        split["sample"] += st.sample_s
        split["schedule+update"] += st.step_s - st.prepare_s - st.forward_s - st.sample_s
        split["output"] += w - st.step_s
    for rid in list(eng.states):
        eng.abort(rid)
    while eng.has_unfinished_requests():
        eng.step()
    wall.sort()
    vocab.sort()
    return {"running": n, "step_ms_p50": 1e3 * wall[len(wall) // 2], "vocab_us": 1e6 * vocab[len(vocab) // 2],
            **{f"{k}_us": round(1e6 * v / steps, 1) for k, v in split.items()}}


class VocabMath:
    """Times every Tensor.argmax inside the timed steps (greedy sampling's reduction over the vocabulary):
    a device's work (an H200 reads a 64 x 128k step's logits in microseconds), which on the CPU this host
    does inside `sample`; reported apart from the host's work, measured in the same steps (timed alone,
    this host's argmax over 256 x 49,152 took 6 or 13 ms from one run to the next)."""

    def __init__(self):
        self.s = 0.0
        self._argmax = torch.Tensor.argmax

    def __enter__(self):
        def timed(t, *a, **k):
            t0 = time.perf_counter()
            out = self._argmax(t, *a, **k)
            self.s += time.perf_counter() - t0
            return out
        torch.Tensor.argmax = timed
        return self

    def __exit__(self, *exc):
        torch.Tensor.argmax = self._argmax


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", default="1,16,64,256")
    ap.add_argument("--T-ms", dest="t_ms", default="0,5")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sampling", choices=("greedy", "top_p"), default="greedy")
    ap.add_argument("--prompt-len", dest="prompt_len", type=int, default=32)
    ap.add_argument("--engine-process", dest="engine_process", action="store_true")
    a = ap.parse_args()
    from pagedserve.config import EngineArgs
    from pagedserve.engine.core_proc import ProcClient
    from pagedserve.engine.core_spawn import spawn_core
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.host import describe
    running = [int(x) for x in a.running.split(",")]
    sampling = {"temperature": 0.0} if a.sampling == "greedy" else {"temperature": 0.8, "top_p": 0.9, "seed": 1}
    blocks_per_seq = -(-(a.prompt_len + 3 + a.steps + 8) // 16) + 1     # prompt, warm-up and timed steps
    args = EngineArgs(max_num_seqs=max(running), max_num_batched_tokens=max(1024, 32 * max(running)),
                      num_kv_blocks=max(running) * max(12, blocks_per_seq) + 64)
    eng = LLMEngine(args)
    print(f"host: {describe()}; sampling {a.sampling}; {eng.core.model.cfg.vocab_size}-entry vocabulary; "
          f"prompts of {a.prompt_len} tokens")
    for t_ms in (float(x) for x in a.t_ms.split(",")):
        fake_device(eng.core.model, t_ms / 1e3, eng.core.model.cfg.vocab_size)
        rows = [measure(eng, n, a.steps, sampling, a.prompt_len) for n in running]
        print(f"T = {t_ms:g} ms")
        report(rows, t_ms)
        if a.engine_process:
            client = ProcClient(args, spawn_core(args, setup=functools.partial(install_fake, t_ms / 1e3)))
            seam_eng = LLMEngine(args, client=client)
            try:
                rows = [measure_seam(seam_eng, n, a.steps, sampling, a.prompt_len) for n in running]
            finally:
                seam_eng.shutdown()
            print(f"T = {t_ms:g} ms, through the process seam (mean interval between StepOutputs taken)")
            report(rows, t_ms)


def report(rows: list[dict], t_ms: float) -> None:
    for r in rows:
        host_ms = r["step_ms_p50"] - t_ms
        rate = r["running"] / (r["step_ms_p50"] / 1e3)
        ideal = r["running"] / (t_ms / 1e3) if t_ms else float("inf")
        split = (f"; schedule+update {r['schedule+update_us']:8.1f} us, prepare {r['prepare_us']:8.1f}, sample "
                 f"{r['sample_us']:8.1f} (of it the vocabulary's argmax {r['vocab_us']:8.1f}), output "
                 f"{r['output_us']:8.1f}") if "prepare_us" in r else ""
        print(f"  {r['running']:4d} running: step {r['step_ms_p50']:7.3f} ms, host {host_ms:7.3f} ms "
              f"({1e3 * host_ms / r['running']:6.1f} us/seq){split}"
              + (f"; {rate:,.0f} rows/s = {rate / ideal:.0%} of rows/T" if t_ms else f"; {rate:,.0f} rows/s"))
    if len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        def host(r):                     # the step (its argmax over the vocabulary taken out) less T
            return r["step_ms_p50"] - t_ms
        slope = (host(hi) - host(lo)) / (hi["running"] - lo["running"])
        print(f"  host work per sequence (slope {lo['running']}..{hi['running']}): {1e3 * slope:.1f} us; fixed: "
              f"{host(lo) - slope * lo['running']:.3f} ms")


if __name__ == "__main__":
    main()
