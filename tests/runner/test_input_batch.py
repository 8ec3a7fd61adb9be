"""The runner's persistent input batch (runner/input_batch.py), kept by the block-table deltas the
scheduler sends, against the batch rebuilt every step from whole block tables (the runner's input
path before issue 53, kept below as the reference). The real Scheduler and KVCacheManager run random
schedules: arrivals, chunked prefill, prefix hits, n > 1 forks (copy-on-write), preemption by
recompute and by swap, n-gram drafts with rejected ones trimmed, sliding-window groups giving blocks
back, aborts. Every step the inputs must be equal, and at the end the batch holds no row."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedserve.config import SpeculativeConfig
from pagedserve.core.spec_decode import Drafting
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_layout import KVLayout
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.step import SchedulerOutput, TableDelta
from pagedserve.runner.input_batch import InputBatch
from pagedserve.runner.model_runner import ModelRunner, _draft_rows
from pagedserve.sampling_params import SamplingParams


def reference_inputs(so: SchedulerOutput, tables: dict[str, tuple[tuple[int, ...], ...]], bs: int,
                     rows_as_decode: bool) -> dict:
    """The step's inputs from whole tables, as ModelRunner.prepare built them before the persistent batch."""
    G = len(next(iter(tables.values())))
    ids, pos = [], []
    slots = [[] for _ in range(G)]
    dec_tables, pre_tables = [[] for _ in range(G)], [[] for _ in range(G)]
    dec_lens, pre_lens, cu_q, logit_rows, sample_rows = [], [], [0], [], []
    for s in so.seqs:
        start, n = s.start, s.num_tokens
        row0, ctx = len(ids), start + n
        ids.extend(s.token_ids)
        pos.extend(range(start, ctx))
        decode = s.is_decode or rows_as_decode
        for g, blocks in enumerate(tables[s.request_id]):
            slots[g].extend(blocks[p // bs] * bs + p % bs for p in range(start, ctx))
            if decode:
                dec_tables[g].extend([blocks] * n)
            else:
                pre_tables[g].append(blocks[: -(-ctx // bs)])
        if decode:
            dec_lens.extend(range(start + 1, ctx + 1))
        else:
            pre_lens.append(ctx)
            cu_q.append(cu_q[-1] + n)
        if s.num_draft:
            logit_rows.extend(range(row0 + n - 1 - s.num_draft, row0 + n))
            sample_rows.extend(_draft_rows(s.sampling, s.draft))
        elif s.sampling is not None:
            logit_rows.extend([row0 + n - 1] * s.sampling.num_samples)
            sample_rows.extend([s.sampling] * s.sampling.num_samples)

    def padded(t):
        width = max(len(x) for x in t)
        return [list(x) + [0] * (width - len(x)) for x in t]
    return dict(ids=ids, pos=pos, logit_rows=logit_rows, sample_rows=sample_rows, groups=[
        dict(slots=slots[g], num_decodes=len(dec_lens), dec_lens=dec_lens, pre_lens=pre_lens,
             cu_q=cu_q if pre_lens else None, dec_tables=padded(dec_tables[g]) if dec_lens else None,
             pre_tables=padded(pre_tables[g]) if pre_lens else None,
             max_decode_context=max(dec_lens, default=0),
             max_prefill_q=max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)) for g in range(G)])


def model_free_runner(layout: KVLayout, bs: int, rows_as_decode: bool) -> ModelRunner:
    """A ModelRunner with only what its input path reads (prepare needs no model or cache)."""
    r = object.__new__(ModelRunner)
    r.block_size, r.layout, r.lora, r.rows_as_decode = bs, layout, None, rows_as_decode
    r.use_native = r.native_prefill = r.bf16_dots = r.two_way_images = r.mrope = False
    r.use_triton = True                          # the host-side maxima are built too
    r.batch = InputBatch(layout.num_groups, rows=2, width=2)   # small: growth is exercised
    return r


def _list(t: torch.Tensor | None):
    return None if t is None else t.tolist()


def assert_same_inputs(runner: ModelRunner, so: SchedulerOutput, ref: dict) -> None:
    ids, pos, md, logit_rows, sample_rows, _, _, _ = runner.prepare(so)
    assert ids.tolist() == ref["ids"] and pos.tolist() == ref["pos"]
    assert ids.dtype == pos.dtype == torch.long
    assert logit_rows == ref["logit_rows"] and sample_rows == ref["sample_rows"]
    mds = [md] if not isinstance(md, list) else [md[runner.layout.layer_group.index(g)]
                                                 for g in range(runner.layout.num_groups)]
    for m, r in zip(mds, ref["groups"], strict=True):
        assert m.slot_mapping.tolist() == r["slots"], "slot_mapping"
        assert m.num_decodes == r["num_decodes"]
        assert _list(m.decode_block_tables) == r["dec_tables"], "decode_block_tables"
        assert (_list(m.decode_context_lens) or []) == r["dec_lens"]
        assert _list(m.prefill_block_tables) == r["pre_tables"], "prefill_block_tables"
        assert _list(m.prefill_cu_q) == r["cu_q"] and (_list(m.prefill_context_lens) or []) == r["pre_lens"]
        assert (m.max_decode_context, m.max_prefill_q) == (r["max_decode_context"], r["max_prefill_q"])
        for t in (m.slot_mapping, m.decode_block_tables, m.prefill_block_tables, m.decode_context_lens):
            assert t is None or t.dtype == torch.long


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_persistent_batch_equals_a_batch_rebuilt_every_step(data):
    d = data.draw
    bs = d(st.sampled_from([1, 2, 4]), label="block_size")
    window = d(st.sampled_from([0, 0, 4, 9]), label="window")      # > 0: a full group and a sliding one
    layout = KVLayout.of([0, window]) if window else KVLayout.uniform(2)
    G = layout.num_groups
    num_blocks = d(st.integers(24 // bs * G + 2, 90 // bs * G + 2), label="num_blocks")
    swap = d(st.booleans(), label="swap")
    kv = KVCacheManager(num_blocks, bs, enable_caching=d(st.booleans(), label="caching"),
                        num_host_blocks=d(st.integers(0, 40), label="host_blocks") if swap else 0,
                        windows=layout.windows)
    drafting = Drafting(SpeculativeConfig(num_speculative_tokens=d(st.integers(1, 4)), adaptive=False)) \
        if d(st.booleans(), label="ngram") else None
    sch = Scheduler(SchedulerConfig(max_num_batched_tokens=d(st.integers(8, 48), label="budget"), max_num_seqs=8,
                                    max_model_len=64, long_prefill_token_threshold=d(st.integers(1, 16)),
                                    preemption_mode="swap" if swap else "recompute"), kv, drafting=drafting)
    rows_as_decode = d(st.booleans(), label="rows_as_decode")
    runner = model_free_runner(layout, bs, rows_as_decode)
    tok = st.integers(1, 5)                      # a small vocabulary: n-gram drafts and prefix hits happen
    seen = 0
    for step in range(d(st.integers(5, 40), label="steps")):
        for _ in range(d(st.integers(0, 2))):
            n = d(st.sampled_from([1, 1, 2]))
            req = Request(f"r{seen}", d(st.lists(tok, min_size=1, max_size=24)), SamplingParams(n=n),
                          max_tokens=d(st.integers(1, 12)), num_samples=n)
            seen += 1
            try:
                sch.add_request(req)
            except ValueError:                   # could never fit this pool
                pass
        if sch.requests and d(st.integers(0, 9)) == 0:
            sch.abort(d(st.sampled_from(sorted(sch.requests))))
        so = sch.schedule()
        whole = {s.request_id: kv.block_tables(s.request_id) for s in so.seqs}   # what used to be sent
        for s in so.seqs:
            assert all(type(t) is TableDelta for t in s.tables) and len(s.tables) in (0, G)   # (): none changed
        runner.batch.update(so)
        if so.seqs:
            for s in so.seqs:
                assert all(runner.batch.table(s.request_id, g) == whole[s.request_id][g] for g in range(G))
            assert_same_inputs(runner, so, reference_inputs(so, whole, bs, rows_as_decode))
        sampled = {}
        for s in so.seqs:
            if s.sampling is None:
                continue
            if s.num_draft:                      # some drafts accepted, then the runner's own token
                k = d(st.integers(0, s.num_draft))
                sampled[s.request_id] = list(s.draft[:k]) + [d(tok)]
            else:
                sampled[s.request_id] = [d(tok) for _ in range(s.sampling.num_samples)]
        list(sch.update_from_output(so, sampled))
        live = {r for r, q in sch.requests.items() if q.request_id in kv.req_blocks}
        assert set(runner.batch.row_of) <= live | set(sch.finished_ids)
    for rid in list(sch.requests):
        sch.abort(rid)
    runner.batch.update(sch.schedule())
    assert len(runner.batch) == 0 and not runner.batch.row_of
    assert all(not t.any() for t in runner.batch.tables) and all(not n.any() for n in runner.batch.num_blocks)
    assert all(v == 0 for v in kv.held().values()), kv.held()


def test_rows_stay_dense_and_tails_are_the_null_block():
    b = InputBatch(2, rows=1, width=1)
    b.apply("a", (TableDelta(0, (1, 2, 3)), TableDelta(0, (4, 5, 6))))
    b.apply("b", (TableDelta(0, (7,)), TableDelta(0, (8,))))
    b.apply("c", (TableDelta(0, (9, 10)), TableDelta(0, (11, 12))))
    b.apply("a", (TableDelta(1, (13,)), TableDelta(3, ())))          # a cut (rejected drafts), nothing
    assert b.table("a", 0) == (1, 13) and b.table("a", 1) == (4, 5, 6)
    assert b.tables[0][b.row_of["a"]].tolist()[:3] == [1, 13, 0]
    b.remove("a")                                                  # the last row takes its place
    assert b.req_ids == ["c", "b"] and b.row_of == {"c": 0, "b": 1}
    assert b.table("c", 1) == (11, 12) and not b.tables[0][2:].any()
    with pytest.raises(ValueError, match="'z'"):
        b.apply("z", (TableDelta(2, (1,)), TableDelta(2, (1,))))   # a change to a table it never got
    b.update(SchedulerOutput(preempted=("c",), finished_req_ids=("b", "never-seen")))
    assert len(b) == 0 and not any(t.any() for t in b.tables)
    assert np.array_equal(b.num_blocks[0], np.zeros_like(b.num_blocks[0]))
