"""The host's per-step cost of the two pieces issue 53's persistent batch changes, without a model:
Scheduler.schedule() (which used to copy each sequence's whole block tables into the step record) and
ModelRunner.prepare() (which rebuilt slots and block tables from those tuples). N sequences decode at a
context of --context tokens through the real scheduler and KV-cache manager; the runner is built
without a model (prepare reads none). Per step: schedule, (the batch's update,) prepare, then the
scheduler applies one fake token per sequence. Reports the median and the best of --steps steps, so
that a run beside other work on a shared machine still compares (the best is the least disturbed).

Runs on any checkout (before the persistent batch too): python bench/input_path.py [--running 1,16,64,256]
[--context 1024] [--steps 200]"""
import argparse
import statistics
import time


def run(n: int, context: int, steps: int) -> dict:
    from pagedserve.core.kv_cache_manager import KVCacheManager
    from pagedserve.core.kv_layout import KVLayout
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler import Scheduler, SchedulerConfig
    from pagedserve.runner.model_runner import ModelRunner
    from pagedserve.sampling_params import SamplingParams
    bs = 16
    kv = KVCacheManager(n * (-(-(context + steps + 48) // bs) + 1) + 2, bs)
    sch = Scheduler(SchedulerConfig(max_num_batched_tokens=max(8192, n), max_num_seqs=n,
                                    max_model_len=context + steps + 96, long_prefill_token_threshold=8192), kv)
    runner = object.__new__(ModelRunner)           # the input path only
    runner.block_size, runner.layout, runner.lora, runner.rows_as_decode = bs, KVLayout.uniform(1), None, False
    runner.use_native = runner.native_prefill = runner.bf16_dots = runner.use_triton = False
    runner.two_way_images = runner.mrope = False   # (no images: read by prepare in checkouts that have them)
    batch = None
    try:
        from pagedserve.runner.input_batch import InputBatch
        batch = runner.batch = InputBatch(1)
    except ImportError:                             # a checkout before the persistent batch
        pass
    for i in range(n):
        sch.add_request(Request(f"r{i}", [(i * 7 + j) % 30000 + 1 for j in range(context)],
                                SamplingParams(max_tokens=steps + 48), max_tokens=steps + 48))
    sched, prep = [], []
    warm = 0                                        # steps until every sequence is past its prompt, and 3 more
    while len(sched) < steps:
        t0 = time.perf_counter()
        so = sch.schedule()
        t1 = time.perf_counter()
        if batch is not None:
            batch.update(so)
        runner.prepare(so)
        t2 = time.perf_counter()
        list(sch.update_from_output(so, {s.request_id: [1] for s in so.seqs if s.sampling is not None}))
        if len(so.seqs) == n and all(s.is_decode for s in so.seqs) and not sch.waiting:
            warm += 1
        if warm > 3:
            sched.append(t1 - t0)
            prep.append(t2 - t1)
    return {"running": n, "schedule_med": statistics.median(sched), "schedule_min": min(sched),
            "prepare_med": statistics.median(prep), "prepare_min": min(prep)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    import pagedserve
    print(f"pagedserve from {pagedserve.__file__}; context {a.context} tokens (block size 16), {a.steps} decode "
          "steps each; us per step (median / best)")
    for n in (int(x) for x in a.running.split(",")):
        r = run(n, a.context, a.steps)
        print(f"  {n:4d} running: schedule {1e6 * r['schedule_med']:8.1f} / {1e6 * r['schedule_min']:8.1f}   "
              f"prepare {1e6 * r['prepare_med']:8.1f} / {1e6 * r['prepare_min']:8.1f}   "
              f"(per sequence: {1e6 * (r['schedule_med'] + r['prepare_med']) / n:6.2f})")


if __name__ == "__main__":
    main()
