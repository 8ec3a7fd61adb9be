"""GEMM row buckets (pagedserve.model.gemm, issue 22): a bounded set of row counts, little padding,
the same products as unpadded GEMMs, and every dense GEMM of a running engine at a bucketed row
count once the padded path is on (forced here with PAGEDSERVE_GEMM_BUCKETS=1, since the hosts
where it is on by itself, AVX-512 ones, are not every host)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import LLM, SamplingParams
from pagedserve.model import gemm as gemm_mod
from pagedserve.model.gemm import bucket, buckets_up_to, gemm, pads_rows
from pagedserve.model.llama import linear
from pagedserve.model.quant import quantize_int8
from tests.model.families import save_family


@pytest.fixture
def forced(monkeypatch):
    def force(on: bool):
        monkeypatch.setenv("PAGEDSERVE_GEMM_BUCKETS", "1" if on else "0")
        pads_rows.cache_clear()
    yield force
    monkeypatch.delenv("PAGEDSERVE_GEMM_BUCKETS", raising=False)
    pads_rows.cache_clear()


def test_buckets_are_few_and_pad_little():
    for m in range(1, 20_000):
        b = bucket(m)
        assert m <= b <= m * 1.125 and bucket(b) == b, m
        assert b == m or m > gemm_mod.EXACT_ROWS
    assert len(buckets_up_to(2048)) == 72 and buckets_up_to(16) == list(range(1, 17))
    assert [bucket(m) for m in (17, 33, 100, 2047)] == [18, 36, 104, 2048]


def test_the_host_rule_and_its_override(forced):
    forced(True)
    assert pads_rows(torch.float32, "cpu")
    forced(False)
    assert not pads_rows(torch.bfloat16, "cpu")
    import os
    os.environ["PAGEDSERVE_GEMM_BUCKETS"] = "yes"
    pads_rows.cache_clear()
    with pytest.raises(ValueError, match="PAGEDSERVE_GEMM_BUCKETS"):
        pads_rows(torch.bfloat16, "cpu")


@pytest.mark.parametrize("rows", [1, 17, 37, 129, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_products_equal_unpadded(forced, rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(rows, 96, generator=g).to(dtype), torch.randn(200, 96, generator=g).to(dtype),
               torch.randn(200, generator=g).to(dtype))
    ref = F.linear(x.float(), w.float(), b.float())
    packed = quantize_int8(w.float())
    packed.small_m = 0                              # the dequantize + GEMM path, which pads
    forced(True)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.5, rtol=0.02)
    for y in (gemm(x, w, b), linear(x, w, b, False), linear(x, w, b, True)):
        assert y.shape == (rows, 200) and y.dtype == dtype and y.is_contiguous()
        torch.testing.assert_close(y.float(), ref, **tol)
    y = packed.matmul(x, b)
    assert y.shape == (rows, 200)
    torch.testing.assert_close(y.float(), F.linear(x.float(), packed.dequantize(), b.float()), **tol)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_every_engine_gemm_runs_at_a_bucket(forced, tmp_path, tokenizer, monkeypatch, name):
    """Prompts of many lengths, chunked prefill and mixed decode batches: F.linear (dense layers, the
    LM head, the MoE router and experts) only ever sees bucketed row counts, and the greedy tokens
    equal those of the unpadded path (float32: padding rows changes no other row's result)."""
    save_family(name, tmp_path, len(tokenizer), tokenizer)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, len(tokenizer), (n,), generator=g).tolist()}
               for n in (3, 17, 29, 45, 70, 101, 133)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run():
        with LLM(str(tmp_path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=160) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setenv("PAGEDSERVE_SMALL_M_GEMM", "linear")     # every product through F.linear, seen below
    forced(False)
    plain = run()
    seen = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, *a, **k: seen.append(x.shape[0]) or real(x, *a, **k))
    forced(True)
    assert run() == plain
    odd = sorted({m for m in seen if bucket(m) != m})
    assert seen and not odd, f"GEMMs at unbucketed row counts: {odd}"
    assert any(m > gemm_mod.EXACT_ROWS for m in seen)       # prefill steps did run padded


def test_every_gemm_shape_is_built_at_load(forced, tmp_path, tokenizer, monkeypatch):
    """gemm.warm: loading runs every (weight shape, row bucket) a step can meet, so serving meets none
    for the first time (no compile inside a step, no RSS step hundreds of requests in): prompts of many
    lengths, chunked prefill, n = 2, prompt logprobs; then a second engine on the same shapes builds
    nothing again (the process keeps them)."""
    save_family("llama", tmp_path, len(tokenizer), tokenizer)
    monkeypatch.setenv("PAGEDSERVE_SMALL_M_GEMM", "linear")     # every product through F.linear, seen below
    monkeypatch.setattr(gemm_mod, "_WARMED", set())
    forced(True)
    phase, seen = ["load"], {"load": set(), "serve": set()}
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, *a, **k: seen[phase[0]].add((tuple(w.shape), x.shape[0]))
                        or real(x, w, *a, **k))
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(0, len(tokenizer), (n,), generator=g).tolist()}
               for n in (3, 17, 29, 45, 70, 101, 133, 250)]
    sps = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, n=1 + i % 2, prompt_logprobs=1 if i % 3 == 0 else None,
                          ignore_eos=True) for i in range(len(prompts))]
    with LLM(str(tmp_path), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=160, max_num_seqs=8) as llm:
        phase[0] = "serve"
        llm.generate(prompts, sps, use_tqdm=False)
    assert seen["serve"] and not seen["serve"] - seen["load"], f"first met while serving: {seen['serve'] - seen['load']}"
    assert {m for _, m in seen["load"]} >= set(buckets_up_to(160))
    phase[0], seen["load"] = "load", set()
    with LLM(str(tmp_path), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=160, max_num_seqs=8):
        pass
    assert not seen["load"]


def test_warm_runs_each_product_once_per_bucket(monkeypatch):
    monkeypatch.setattr(gemm_mod, "_WARMED", set())
    calls = []
    product = ("w", lambda x: calls.append(x.shape), 24, torch.float32, 4, 40)
    line = gemm_mod.Warmup([product, product]).run()
    assert calls == [(m, 24) for m in buckets_up_to(40) if m > 4] and line.startswith(f"{len(calls)} built")
    calls.clear()
    gemm_mod.Warmup([product]).run()
    assert not calls


def test_a_warmup_steps_a_slice_at_a_time(monkeypatch):
    """Warmup.step (serve's idle time after ready): at least one build a call, each bucket once, the
    same set `run` builds; an empty job is done at once and says why."""
    monkeypatch.setattr(gemm_mod, "_WARMED", set())
    calls = []
    job = gemm_mod.Warmup([("w", lambda x: calls.append(x.shape[0]), 24, torch.float32, 4, 40)])
    steps = 0
    while job.step(budget_s=0.0):
        steps += 1
        assert len(calls) == steps and not job.done
    assert job.done and calls == [m for m in buckets_up_to(40) if m > 4] and len(calls) == steps
    assert job.line().startswith(f"{len(calls)} built") and not job.step()
    empty = gemm_mod.Warmup(note="nothing to build ahead")
    assert empty.done and empty.line() == "nothing to build ahead"


def test_serve_builds_the_gemm_shapes_after_ready_and_no_token_changes(forced, tmp_path, tokenizer, monkeypatch):
    """warm_at_load False (serve): the engine is ready with no shape built; a request then runs exactly as
    in an engine warmed at load; the async engine's idle loop builds every bucket, recorded after ready."""
    import time
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.llm_engine import LLMEngine
    save_family("llama", tmp_path, len(tokenizer), tokenizer)
    forced(True)
    kw = dict(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=96, max_num_seqs=4)
    prompt = {"prompt_token_ids": list(range(5, 40))}
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens(eng) -> list[int]:
        rid = eng.add_request(None, prompt, sp)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished and out.request_id == rid:
                    return list(out.outputs[0].token_ids)

    monkeypatch.setattr(gemm_mod, "_WARMED", set())
    lazy = LLMEngine(warm_at_load=False, **kw)
    assert not gemm_mod._WARMED and not lazy.core.gemm_warmup.done and "GEMM shapes" in lazy.startup.seconds()
    before = tokens(lazy)                                   # a request before any shape was built ahead
    aeng = AsyncLLMEngine(lazy)
    try:
        t0 = time.time()
        while not lazy.core.gemm_warmup.done and time.time() - t0 < 120:
            time.sleep(0.05)
    finally:
        aeng.shutdown()
    assert lazy.core.gemm_warmup.done and lazy.startup.after_ready["GEMM shapes"] > 0
    assert {m for _, m in gemm_mod._WARMED} >= set(buckets_up_to(96))
    assert "after_ready" in lazy.startup.as_dict()
    monkeypatch.setattr(gemm_mod, "_WARMED", set())
    eager = LLMEngine(**kw)                                 # every shape built at load
    assert {m for _, m in gemm_mod._WARMED} >= set(buckets_up_to(96)) and not eager.warm_idle()
    assert tokens(eager) == before
