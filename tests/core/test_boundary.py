"""The scheduler -> runner boundary is typed and one-way: a fake runner that sees only the step's
immutable records (never a Request) drives the real scheduler to the right tokens, and every
block comes back. `pagedserve.core` imports without torch."""
import dataclasses
import subprocess
import sys

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager, TableDelta
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.step import SamplingRow, ScheduledSeq, SchedulerOutput
from pagedserve.sampling_params import SamplingParams


def canned(rid: str, position: int, k: int) -> int:
    """The token a sequence gets at `position` (k: which sample of a forking row)."""
    return 100 + (sum(map(ord, rid)) * 7 + position * 13 + k * 101) % 900


class FakeRunner:
    """Returns canned tokens; refuses anything but the typed, frozen step records."""

    def execute(self, so: SchedulerOutput) -> dict[str, list[int]]:
        assert isinstance(so.seqs, tuple)
        out = {}
        for s in so.seqs:
            assert type(s) is ScheduledSeq and isinstance(s.token_ids, tuple) and isinstance(s.tables, tuple) and all(type(t) is TableDelta and isinstance(t.block_ids, tuple) for t in s.tables)
            with pytest.raises(dataclasses.FrozenInstanceError):
                s.start = 0
            assert not any(isinstance(getattr(s, f.name), Request) for f in dataclasses.fields(s))
            if s.sampling is not None:
                assert type(s.sampling) is SamplingRow
                pos = s.start + s.num_tokens
                out[s.request_id] = [canned(s.request_id, pos, k) for k in range(s.sampling.num_samples)]
        return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_and_fake_runner_give_every_request_its_tokens(mode):
    kv = KVCacheManager(24, 4, True, num_host_blocks=64 if mode == "swap" else 0)
    sch = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
                                    long_prefill_token_threshold=8, preemption_mode=mode), kv)
    reqs = {}
    for i in range(10):
        n = 1 + i % 3
        rid = f"r{i}"
        sp = SamplingParams(n=n, max_tokens=6 + i, ignore_eos=True)
        sch.add_request(Request(rid, [5 + i] * (3 + 2 * i), sp, 6 + i, num_samples=n))
        reqs[rid] = n
    runner, seqs, steps = FakeRunner(), {}, 0
    while sch.has_unfinished():
        so = sch.schedule()
        for u in sch.update_from_output(so, runner.execute(so)):
            seqs[u.request.request_id] = u.request
        steps += 1
        assert steps < 500
    assert sch.num_preemptions > 0
    for rid, n in reqs.items():
        family = [seqs[rid]] + [seqs[f"{rid}#{k}"] for k in range(1, n)]
        for k, r in enumerate(family):
            assert r.num_output_tokens == r.max_tokens and r.status.finished
            # the first token was sampled for the family from the parent's row; the rest are each sequence's own
            expect = [canned(rid, r.num_prompt_tokens, k)] + [canned(r.request_id, r.num_prompt_tokens + j, 0)
                                                              for j in range(1, r.max_tokens)]
            assert r.output_token_ids == expect
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks[1:]) and not kv.req_blocks and not kv.swapped


def test_core_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import pagedserve.core.scheduler, pagedserve.core.step, pagedserve.core.kv_cache_manager\n"
            "import pagedserve\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')"
            " and sys.modules[m] is not None]")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_clock_is_injectable():
    t = [100.0]
    kv = KVCacheManager(16, 4, False)
    sch = Scheduler(SchedulerConfig(max_model_len=64), kv, clock=lambda: t[0])
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=2), 2, arrival_time=99.0)
    sch.add_request(r)
    so = sch.schedule()
    t[0] = 101.5
    list(sch.update_from_output(so, {"a": [7]}))
    assert (r.first_scheduled_time, r.first_token_time) == (100.0, 101.5)
