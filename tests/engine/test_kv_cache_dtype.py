"""--kv-cache-dtype: the pool holds more tokens in the same memory, and greedy output stays close
to float32 KV by the rule vLLM uses to compare backends (check_logprobs_close); so do
--dtype bfloat16 (bf16 weights, and KV following them) and --quantization int8 / gguf against
float32 dense weights:

    for each prompt, the greedy token lists are equal; or, at the first position where they
    differ, each engine's token is among the other engine's top-5 logprobs there. Positions
    after the first difference are not compared (the continuations legitimately diverge).
"""
import re

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.conftest import CHAT_PROMPTS

PROMPTS = CHAT_PROMPTS[:8]
TOKENS = 64


def _greedy(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _packed(llm):
    from pagedserve.model.quant import PackedLinear
    eng = getattr(llm, "engine", llm)
    return [m.weight for m in eng.core.model.modules() if isinstance(m, PackedLinear)]


def _assert_logprobs_close(ref, other, name):
    for k, ((ta, la), (tb, lb)) in enumerate(zip(ref, other)):
        assert len(ta) == len(tb) == TOKENS
        for i, (a, b) in enumerate(zip(ta, tb)):
            if a != b:
                assert a in lb[i], f"{name}, prompt {k}: float32's token {a} not in {name}'s top-5 at {i}"
                assert b in la[i], f"{name}, prompt {k}: {name}'s token {b} not in float32's top-5 at {i}"
                break


@pytest.fixture(scope="module")
def fp32_greedy(llm):
    assert llm.engine.core.kv_cache_dtype_name == "float32"
    return _greedy(llm)


@pytest.mark.parametrize("dtype,kv,quant", [("float32", "bfloat16", "none"), ("float32", "int8", "none"),
                                            ("bfloat16", "auto", "none"), ("float32", "float32", "int8"),
                                            ("bfloat16", "auto", "int8"), ("bfloat16", "auto", "gguf"),
                                            ("auto", "auto", "gguf"), ("auto", "auto", "auto")])
def test_greedy_close_to_float32(dtype, kv, quant, fp32_greedy):
    other = LLM(num_kv_blocks=1024, dtype=dtype, kv_cache_dtype=kv, quantization=quant)
    # packed weights multiply int8-rounded activations (qmatmul_q8) unless float32 was asked for
    assert all(w.int8_act == (quant != "none" and dtype != "float32") for w in _packed(other))
    # auto: as --dtype, and bfloat16 wherever --dtype auto computes in float32 (host.auto_kv_cache_dtype)
    auto = 2 if dtype == "auto" else other.engine.core.model.norm.dtype.itemsize
    want = {"int8": 1, "float32": 4, "bfloat16": 2}.get(kv, auto)
    assert other.engine.core.runner.kv_cache.dtype.itemsize == want
    _assert_logprobs_close(fp32_greedy, _greedy(other), f"--dtype {dtype} --kv-cache-dtype {kv} --quantization {quant}")


def test_auto_dtype_follows_the_cpu(monkeypatch):
    from pagedserve import host
    monkeypatch.setattr(host, "cpu_info", lambda: ("AMD EPYC", frozenset({"avx2", "fma"})))
    assert host.auto_dtype("cpu") == ("float32", "the CPU has neither amx_bf16 nor avx512_bf16")
    monkeypatch.setattr(host, "cpu_info", lambda: ("Xeon", frozenset({"avx512f", "avx512_bf16", "amx_bf16"})))
    assert host.auto_dtype("cpu") == ("bfloat16", "the CPU multiplies bf16 natively (amx_bf16, avx512_bf16)")
    assert host.auto_dtype("cuda")[0] == "bfloat16"


def test_auto_kv_cache_dtype_is_bf16_storage_where_auto_computes_in_float32(caplog):
    """--kv-cache-dtype auto: as --dtype, except where --dtype auto is float32 for want of bf16 arithmetic (an
    AVX2 host): bf16 storage there, as llama.cpp's f16 cache beside f32 arithmetic; --dtype float32 asked for
    keeps a float32 cache (the exact path), and a GPU follows its dtype."""
    from pagedserve.host import auto_kv_cache_dtype
    assert auto_kv_cache_dtype("cpu", "auto", "float32")[0] == "bfloat16"
    assert auto_kv_cache_dtype("cpu", "auto", "bfloat16")[0] == "bfloat16"
    assert auto_kv_cache_dtype("cpu", "float32", "float32")[0] == "float32"
    assert auto_kv_cache_dtype("cuda", "auto", "bfloat16")[0] == "bfloat16"
    assert auto_kv_cache_dtype("cuda", "float32", "float32")[0] == "float32"
    with caplog.at_level("INFO", logger="pagedserve"):
        core = LLM(num_kv_blocks=16).engine.core            # --dtype auto on this host, whichever it is
    assert core.kv_cache_dtype_name == "bfloat16" and core.runner.kv_cache.dtype == torch.bfloat16
    assert "KV cache dtype bfloat16 (auto: " in caplog.text
    assert core.kv_cache_bytes_per_token == 2 * 30 * 3 * 64 * 2         # K and V, 30 layers, 3 kv heads of 64


def test_chosen_path_is_logged(caplog):
    from pagedserve.host import auto_dtype
    with caplog.at_level("INFO", logger="pagedserve"):
        eng = LLM(num_kv_blocks=64, quantization="int8").engine
    want, why = auto_dtype("cpu")
    assert f"dtype {want} ({why})" in caplog.text
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    # 30 x 4 fused matrices + the tied embedding, in the kernels' layout (x8 groups where the host interleaves),
    # the same words on a packed-cache hit and a miss
    assert re.search(rf"\({want} packed I8(x8)? x 121\)", plan), plan
    assert eng.core.weights_bytes < 0.3 * 4 * 134e6     # int8 + scales vs 134M float32 weights


def test_default_flags_keep_the_file_packed_beside_a_dense_copy(caplog):
    """--quantization auto (the default) on the bundled Q4_1 file: packed blocks for few-row steps and, in
    bf16, a dense copy for many-row ones, logged with the reason; --dtype float32 stays dense (the exact path).
    A host without bf16 arithmetic (AVX2 only) computes in float32 by default, where the 135M model's copies
    (~0.5 GiB) are over dense_copy_plan's size rule: packed, no copies, and the plan says why."""
    from pagedserve.host import auto_dtype
    from pagedserve.model.quant import dense_copy_plan
    with caplog.at_level("INFO", logger="pagedserve"):
        eng = LLM(num_kv_blocks=64).engine
    assert eng.core.quantization == "gguf" and "quantization gguf (auto: the GGUF file's blocks packed" in caplog.text
    packed = _packed(eng)
    assert packed and all(w.int8_act for w in packed)
    if auto_dtype("cpu")[0] == "bfloat16":
        assert eng.core.model.weights_desc.endswith("+ dense copies")      # (the load may be cached: no log line)
        assert all(w.dense is not None for w in packed)
    else:
        assert not eng.core.model.weights_desc.endswith("+ dense copies")
        assert not any(w.dense is not None for w in packed)
        assert "above the 512 MiB a model gets them at" in dense_copy_plan(eng.core.model, torch.float32)[1]
    caplog.clear()
    eng = LLM(num_kv_blocks=64, dtype="bfloat16").engine        # every host: bf16 asked for, copies made
    assert eng.core.model.weights_desc.endswith("+ dense copies")
    assert all(w.dense is not None and w.dense.dtype == torch.bfloat16 and w.int8_act for w in _packed(eng))
    caplog.clear()
    with caplog.at_level("INFO", logger="pagedserve"):
        eng = LLM(num_kv_blocks=64, dtype="float32").engine
    assert eng.core.quantization == "none" and "auto: dense for --dtype float32" in caplog.text and not _packed(eng)


def test_same_memory_admits_more_tokens():
    """Bytes per token: 2 x layers x kv heads x (head_dim x dtype bytes + a float32 scale for int8)."""
    blocks = {}
    for kv in ("float32", "bfloat16", "int8"):
        eng = LLM(kv_cache_memory="64MiB", kv_cache_dtype=kv).engine
        c = eng.core.model_config
        per_head = {"float32": 4 * c.head_dim, "bfloat16": 2 * c.head_dim, "int8": c.head_dim + 4}[kv]
        assert eng.core.kv_cache_bytes_per_token == 2 * c.num_layers * c.num_kv_heads * per_head
        assert eng.core.kv_cache_bytes == eng.core.kv.pool.num_blocks * eng.args.block_size * eng.core.kv_cache_bytes_per_token
        assert eng.core.kv_cache_bytes <= 64 * 2**20
        blocks[kv] = eng.core.kv.pool.num_blocks
    assert blocks["bfloat16"] == pytest.approx(2 * blocks["float32"], abs=1)
    assert blocks["int8"] == pytest.approx(4 * 64 / 68 * blocks["float32"], abs=2)


def test_int8_scales_travel_with_swapped_blocks(sharp_llama):
    """Swap preemption moves K/V and their scales to host memory and back: greedy output equals an
    unpressured run's (in float32 weights: the batch-invariant path, as batches differ between the two).
    What moves where is the engine's bookkeeping, not the default model's outputs: a random Llama of 512
    words (conftest's sharp_llama)."""
    prompts = [{"prompt_token_ids": list(range(3 + 40 * i, 43 + 40 * i))} for i in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    roomy = LLM(sharp_llama, num_kv_blocks=512, kv_cache_dtype="int8", dtype="float32").generate(
        prompts, sp, use_tqdm=False)
    # 20 blocks of 16 for the 6 x 72 tokens: requests are swapped out and back (3 times) and decode on after it
    tight = LLM(sharp_llama, num_kv_blocks=20, kv_cache_dtype="int8", preemption_mode="swap", swap_space=0.05,
                dtype="float32")
    got = tight.generate(prompts, sp, use_tqdm=False)
    assert tight.engine.core.counters.preemptions > 0, "the pool was meant to be too small"
    assert tight.engine.core.runner.host_scales.abs().sum() > 0, "preemptions were meant to swap, not recompute"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in roomy]
