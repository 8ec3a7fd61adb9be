"""Every supported family against HF transformers on the same random weights (float32): logits of a
prompt longer than the sliding window, on both attention paths (the C kernels and torch), and greedy
tokens through the whole engine with chunked prefill and with preemption."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.model.loader import load_model, read_model_config, resolve_model
from pagedserve.runner.model_runner import ModelRunner
from tests.model.families import family_specs, save_family
from tests.model.helpers import (assert_greedy_match, blocks_for, forward_all_rows, group_tables, hf_greedy,
                                 make_request)

FAMILIES = list(family_specs())


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """family -> (folder, HF model), built once per module (each is a few MB)."""
    out = {}
    for name in FAMILIES:
        d = tmp_path_factory.mktemp(name)
        out[name] = (str(d), save_family(name, d, len(tokenizer), tokenizer, sharpen=5.0))
    return out


def _prompts(n_vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, n_vocab, (n,), generator=g).tolist() for n in (5, 40, 90)]


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hf_on_both_attention_paths(saved, name):
    d, hf = saved[name]
    model, cfg = load_model(resolve_model(d))
    assert cfg.arch == name
    ids = _prompts(cfg.vocab_size)[2]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    for native in (True, False):
        runner = ModelRunner(model, num_blocks=1 + 6 * cfg.kv_layout.num_groups, block_size=16)
        runner.use_native = runner.use_native and native
        ours = forward_all_rows(runner, [(make_request("a", ids), 0, len(ids), blocks_for(1, len(ids), 16))])
        assert (ours - ref).abs().max().item() < 1e-4, (name, "native" if native else "torch")


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_through_the_engine_matches_hf(saved, name):
    """Chunked prefill (16-token chunks) and a pool so small that requests are preempted."""
    d, hf = saved[name]
    prompts = _prompts(hf.config.vocab_size)
    refs = [hf_greedy(hf, p, 24) for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # preempted: a pool below what the three sequences hold at once, above what one holds (a window
    # group holds only its window: with every layer sliding that pool is smaller still)
    windows = read_model_config(resolve_model(d)).kv_layout.windows
    one = KVCacheManager(2, 8, windows=windows).max_blocks_held(90 + 24, 64)
    tight = dict(num_kv_blocks=one + 3, block_size=8, max_num_batched_tokens=64)
    if name in ("mistral", "mixtral"):
        tight = dict(num_kv_blocks=8, block_size=8, max_num_batched_tokens=16, long_prefill_token_threshold=16)
    for args in (dict(max_num_batched_tokens=64, long_prefill_token_threshold=16), tight):      # chunked, preempted
        llm = LLM(d, dtype="float32", **({"num_kv_blocks": 64} | args))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, (ref, ref_lp) in zip(outs, refs):
            assert_greedy_match(list(out.outputs[0].token_ids), ref, ref_lp, tol=1e-4)
        if "num_kv_blocks" in args:
            assert llm.engine.core.scheduler.num_preemptions > 0
        llm.shutdown()


def _as_llama_cpp_writes_it(name: str, hf, tmp_path):
    """The family's test model, re-saved where a GGUF of that architecture cannot say what the test
    model does (llama.cpp's fixed patterns and scales, no windows in some archs)."""
    v = hf.config.vocab_size
    if name == "gemma3_text":      # what a gemma3 GGUF can say: every 6th layer global, local RoPE base 10000
        return save_family(name, tmp_path / "hf", v, sharpen=5.0, head_dim=32, num_hidden_layers=6,
                           sliding_window=24, query_pre_attn_scalar=32)
    if name == "gemma2":           # llama.cpp scales by 1/sqrt(head_dim) below 27B: query_pre_attn_scalar = head_dim
        return save_family(name, tmp_path / "hf", v, sharpen=5.0, head_dim=16, num_hidden_layers=4,
                           sliding_window=24, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                           final_logit_softcapping=3.0)
    if name == "qwen3":            # llama.cpp's qwen3 has no sliding layers
        return save_family(name, tmp_path / "hf", v, sharpen=5.0, head_dim=32)
    if name == "smollm3":          # llama.cpp's smollm3: every 4th layer without RoPE (no key says so)
        return save_family(name, tmp_path / "hf", v, sharpen=5.0, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                           pad_token_id=0)
    if name == "mixtral":          # llama.cpp writes Mixtral as a llama with experts (and no window)
        return save_family(name, tmp_path / "hf", v, sharpen=5.0, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen3_moe":        # llama.cpp's qwen3moe: every layer an MoE layer, top-k renormalised
        return save_family(name, tmp_path / "hf", v, sharpen=5.0, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=48, head_dim=16, norm_topk_prob=True, mlp_only_layers=[])
    return hf


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "gemma2", "granite", "qwen3_moe", "smollm3", "phi3",
                                  "mixtral"])
def test_gguf_file_loads_to_the_same_model(saved, tmp_path, name):
    """A GGUF written as llama.cpp's converter writes this architecture: the same logits and greedy tokens."""
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler import ScheduledSeq, SchedulerOutput
    from tests.model.families import write_gguf
    hf = _as_llama_cpp_writes_it(name, saved[name][1], tmp_path)
    path = write_gguf(name, hf, tmp_path / f"{name}.gguf")
    model, cfg = load_model(resolve_model(path))
    assert (cfg.arch, cfg.qk_norm) == ({"mixtral": "llama"}.get(name, name.removesuffix("_text").replace("_", "")),
                                       name in ("qwen3", "gemma3_text", "qwen3_moe"))
    ids = _prompts(cfg.vocab_size)[2]
    with torch.inference_mode():
        ref_logits = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(model, num_blocks=1 + 6 * cfg.kv_layout.num_groups, block_size=16)
    ours = forward_all_rows(runner, [(make_request("a", ids), 0, len(ids), blocks_for(1, len(ids), 16))])
    assert (ours - ref_logits).abs().max().item() < 1e-4
    for prompt in _prompts(cfg.vocab_size):
        ref, ref_lp = hf_greedy(hf, prompt, 16)
        runner = ModelRunner(model, num_blocks=20 * cfg.kv_layout.num_groups, block_size=16)
        req = Request("r", prompt, SamplingParams(max_tokens=16), max_tokens=16)
        blocks, start, n = group_tables(runner, list(range(1, 20))), 0, len(prompt)
        for _ in range(16):
            out = runner.execute(SchedulerOutput(seqs=(ScheduledSeq.of(req, start, n, blocks, True),)))
            req.append_token(out.sampled["r"][0].token_id)
            start, n = start + n, 1
        assert_greedy_match(req.output_token_ids, ref, ref_lp, tol=1e-4)


BF16_INT8 = [(n, dict(dtype="bfloat16")) for n in FAMILIES if n not in ("llama", "mistral", "qwen2")] + \
    [(n, dict(dtype="float32", quantization="int8")) for n in ("qwen3", "gemma3_text", "phi3", "mixtral")]


@pytest.mark.parametrize("name,kw", BF16_INT8, ids=[f"{n}-{'-'.join(kw.values())}" for n, kw in BF16_INT8])
def test_bf16_and_int8_close_to_float32(saved, name, kw):
    """--dtype bfloat16 and --quantization int8 (attention and dense matrices; experts stay dense) by
    the closeness rule of tests/engine/test_kv_cache_dtype.py: equal greedy tokens, or at the first
    difference each token in the other's top-5. (Qwen3-MoE with int8 is left out: on these random
    weights int8 noise flips the router's choice between near-equal experts and the near-uniform
    next-token distribution then leaves the top-5; bf16 covers its code path.)"""
    from tests.engine.test_kv_cache_dtype import TOKENS, _assert_logprobs_close
    d, hf = saved[name]
    prompts = [{"prompt_token_ids": p} for p in _prompts(hf.config.vocab_size)]
    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)

    def greedy(**args):
        with LLM(d, num_kv_blocks=64, **args) as llm:
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, sp, use_tqdm=False)]
    _assert_logprobs_close(greedy(dtype="float32"), greedy(**kw), f"{name} {kw}")


@pytest.mark.parametrize("name", ["mistral", "mixtral"])
def test_sliding_window_model_runs_in_a_pool_smaller_than_its_sequences(saved, name):
    """Every layer slides over 24 positions: 114-token sequences (15 blocks of 8) run in a pool of 8
    usable blocks, their blocks behind the window given back as they go, tokens still HF's."""
    d, hf = saved[name]
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(d, dtype="float32", num_kv_blocks=9, block_size=8, max_num_batched_tokens=16,
             long_prefill_token_threshold=16) as llm:
        assert llm.engine.core.kv.windows == (24,)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.core.kv.num_free_blocks == 8
    for out, p in zip(outs, prompts):
        ref, ref_lp = hf_greedy(hf, p, 24)
        assert_greedy_match(list(out.outputs[0].token_ids), ref, ref_lp, tol=1e-4)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "qwen3"])
def test_window_groups_give_blocks_back_while_full_layers_keep_theirs(saved, name):
    """Mixed layers (core/kv_layout.py): each window group's table holds only the blocks its window
    reads (the null block behind it), the full group's holds every block; tokens still HF's."""
    d, hf = saved[name]
    prompt = _prompts(hf.config.vocab_size)[2]                # 90 tokens, windows of 24
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(d, dtype="float32", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16,
             long_prefill_token_threshold=16) as llm:
        eng = llm.engine
        assert len(eng.core.kv.windows) > 1 and 0 in eng.core.kv.windows and 24 in eng.core.kv.windows
        eng.add_request("a", {"prompt_token_ids": prompt}, sp)
        seen, out = 0, None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o if o.finished else out
            if "a" in eng.core.kv.req_blocks:
                n = eng.core.scheduler.requests["a"].num_computed_tokens
                for w, table in zip(eng.core.kv.windows, eng.core.kv.block_tables("a")):
                    live = sum(b != 0 for b in table)
                    assert live == len(table) if not w else live <= -(-(w - 1 + 16) // 8) + 1, (w, n, table)
                    seen += bool(w) and live < len(table)
        assert seen > 0 and eng.core.kv.num_free_blocks == eng.core.kv.pool.num_usable_blocks
    ref, ref_lp = hf_greedy(hf, prompt, 24)
    assert_greedy_match(list(out.outputs[0].token_ids), ref, ref_lp, tol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "gemma2", "granite", "smollm3", "qwen3_moe", "mixtral", "phi3"])
def test_packed_gguf_weights_compute_what_the_dequantized_model_computes(saved, tmp_path, name):
    """A Q8_0 GGUF of each family loaded with --quantization gguf in float32: the projection matrices
    stay packed (the qmatmul kernels read them) and the logits are the dequantized model's."""
    from pagedserve.model.quant import PackedWeight
    from tests.model.families import write_gguf
    hf = _as_llama_cpp_writes_it(name, saved[name][1], tmp_path)
    path = write_gguf(name, hf, tmp_path / f"{name}-q8.gguf", qtype="Q8_0")
    ids = _prompts(hf.config.vocab_size)[2]
    logits = {}
    for quant in ("gguf", "none"):
        model, cfg = load_model(resolve_model(path), quantization=quant)
        packed = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), PackedWeight)]
        assert bool(packed) == (quant == "gguf"), (quant, packed[:3])
        if quant == "gguf":        # every projection of the attention stays packed (fused or not)
            assert all(f"layers.{i}.qkv_proj" in packed and f"layers.{i}.o_proj" in packed
                       for i in range(cfg.num_layers)), packed
        runner = ModelRunner(model, num_blocks=1 + 6 * cfg.kv_layout.num_groups, block_size=16)
        logits[quant] = forward_all_rows(runner, [(make_request("a", ids), 0, len(ids), blocks_for(1, len(ids), 16))])
    assert (logits["gguf"] - logits["none"]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "granite", "mixtral"])
def test_packed_rows_in_groups_of_8_compute_what_the_file_rows_do(saved, tmp_path, name, monkeypatch):
    """int8 activations (the bf16 / auto path) on a Q8_0 GGUF of each family: the load regroups the packed
    matrices 8 rows at a time (PackedWeight.interleave) and the logits are those of the same model on the
    file's rows (PAGEDSERVE_INTERLEAVE=0) but for float summation order: a 40-row prefill on the packed
    kernels (MAXM rows at a time), then decode steps (the fused call where the family takes it)."""
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler import ScheduledSeq, SchedulerOutput
    from pagedserve.model import loader
    from pagedserve.model.quant import PackedWeight
    from tests.model.families import write_gguf
    from tests.model.helpers import packed_up_to
    hf = _as_llama_cpp_writes_it(name, saved[name][1], tmp_path)
    path = write_gguf(name, hf, tmp_path / f"{name}-q8.gguf", qtype="Q8_0")
    prompt = _prompts(hf.config.vocab_size)[1]
    logits, fmts = {}, {}
    for grouped in (True, False):
        monkeypatch.setattr(loader, "_LOADED", {})                # a fresh load per layout
        monkeypatch.setenv("PAGEDSERVE_INTERLEAVE", "1" if grouped else "0")
        model, cfg = load_model(resolve_model(path), quantization="gguf", int8_act=True)
        packed_up_to(model, 64)
        fmts[grouped] = {m.weight.fmt for m in model.modules() if isinstance(getattr(m, "weight", None), PackedWeight)}
        runner = ModelRunner(model, num_blocks=20 * cfg.kv_layout.num_groups, block_size=16)
        req = Request("r", prompt, SamplingParams(max_tokens=8), max_tokens=8)
        ids = list(range(1, 20))
        blocks, start, n, rows = group_tables(runner, ids), 0, len(prompt), []
        for _ in range(4):                                        # the prefill, then 3 decode steps
            rows.append(forward_all_rows(runner, [(req, start, n, ids)])[-1])
            out = runner.execute(SchedulerOutput(seqs=(ScheduledSeq.of(req, start, n, blocks, True),)))
            req.append_token(out.sampled["r"][0].token_id)
            start, n = start + n, 1
        logits[grouped] = torch.stack(rows)
    assert fmts == {True: {"Q8_0x8"}, False: {"Q8_0"}}, fmts
    # the products differ in float summation order only; rounding the next layer's input to int8 can turn
    # that into a step of 1/127 of a block's largest value, so: within 2 % and each argmax in the other's top-5
    a, b = logits[True], logits[False]
    assert (a - b).abs().max().item() < 2e-2 * b.abs().max().item()
    for x, y in ((a, b), (b, a)):
        assert (y.topk(5, dim=-1).indices == x.argmax(-1, keepdim=True)).any(-1).all()


def test_one_table_for_every_layer_when_the_hybrid_manager_is_off(saved):
    """--disable-hybrid-kv-cache-manager (vLLM's flag): Gemma 3's layers share one table, nothing is
    given back behind the windows (the attention still applies them), tokens still HF's."""
    d, hf = saved["gemma3_text"]
    prompt = _prompts(hf.config.vocab_size)[2]
    with LLM(d, dtype="float32", num_kv_blocks=64, block_size=8, disable_hybrid_kv_cache_manager=True) as llm:
        eng = llm.engine
        assert eng.core.kv.windows == (0,) and eng.core.runner.layout.planes == hf.config.num_hidden_layers
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    ref, ref_lp = hf_greedy(hf, prompt, 24)
    assert_greedy_match(list(out.outputs[0].token_ids), ref, ref_lp, tol=1e-4)
