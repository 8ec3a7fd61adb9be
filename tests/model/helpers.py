"""Run a model over hand-built batches through the real runner input path."""
from __future__ import annotations

import torch

from pagedserve.core.request import Request
from pagedserve.core.scheduler import ScheduledSeq, SchedulerOutput
from pagedserve.core.step import TableDelta, whole
from pagedserve.runner.model_runner import ModelRunner
from pagedserve.sampling_params import SamplingParams


def make_request(rid: str, ids: list[int]) -> Request:
    return Request(rid, list(ids), SamplingParams(), max_tokens=1)


def forward_all_rows(runner: ModelRunner, chunks: list[tuple[Request, int, int, list[int]]]) -> torch.Tensor:
    """chunks: (request, start, num_tokens, block_ids). Returns logits of every row (T, V)."""
    seqs = sorted((ScheduledSeq.of(r, s, n, group_tables(runner, b), False) for r, s, n, b in chunks),
                  key=lambda s: not s.is_decode)
    so = SchedulerOutput(seqs=tuple(seqs))
    with torch.inference_mode():
        runner.batch.update(so)
        ids, pos, md, *_ = runner.prepare(so)
        hidden = runner.model(ids, pos, runner.kv_caches, md)
        return runner.model.compute_logits(hidden)


def group_tables(runner: ModelRunner, blocks: list[int]) -> tuple[TableDelta, ...]:
    """A whole block table per KV group of the runner's model (core/kv_layout.py): the same logical
    blocks, each group on physical blocks of its own (shifted past the previous group's); runner's pool
    must hold groups x max(blocks) + 1 blocks."""
    top = max(blocks, default=0)
    return whole(tuple(b + g * top for b in blocks) for g in range(runner.layout.num_groups))


def blocks_for(first: int, n_tokens: int, bs: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // bs)))


def hf_greedy(hf_model, ids: list[int], n: int):
    """HF's greedy continuation of n tokens (EOS ignored) and its per-step log-probabilities."""
    with torch.inference_mode():
        x = torch.tensor([ids])   # an explicit mask: HF would otherwise mask prompt tokens equal to pad_token_id
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(l[0].float(), -1) for l in out.logits]
    return toks, lps


def edited_copy(path: str, tmp_path, name: str, edit: dict) -> str:
    """A copy of the model folder `path` at tmp_path / name whose JSON files are changed: {file: change(cfg)}."""
    import json
    import shutil
    d = tmp_path / name
    shutil.copytree(path, d)
    for f, change in edit.items():
        cfg = json.loads((d / f).read_text())
        change(cfg)
        (d / f).write_text(json.dumps(cfg))
    return str(d)


def hf_greedy_inputs(hf_model, inputs, n: int):
    """HF's greedy continuation of a processor's inputs (images included; EOS ignored): its tokens, per-step
    log-probabilities, and the prompt ids the processor built."""
    with torch.inference_mode():
        out = hf_model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
    ids = inputs["input_ids"][0].tolist()
    return out.sequences[0, len(ids):].tolist(), [torch.log_softmax(l[0].float(), -1) for l in out.logits], ids


def assert_greedy_match(ours: list[int], ref: list[int], ref_logprobs, tol: float = 1e-3) -> None:
    """Token-for-token equality; a mismatch is accepted only as a numerical near-tie: at the first
    differing position both tokens' reference logprobs must differ by less than `tol` (vLLM's
    check_logprobs_close rule); the sequences legitimately diverge after it."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = abs(ref_logprobs[i][a].item() - ref_logprobs[i][b].item())
            assert gap < tol, f"position {i}: ours {a} vs HF {b}, logprob gap {gap:.2e} (not a near-tie)"
            return
    assert len(ours) == len(ref)


def save_random_llama(d, tokenizer, **config) -> str:
    """A seeded random Llama (HF's own class) with the default model's tokenizer, saved as safetensors
    in d: an HF folder any engine loads. `config`: LlamaConfig fields over small defaults."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
    LlamaForCausalLM(LlamaConfig(**(cfg | config))).save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return str(d)


def packed_up_to(model, rows: int = 64) -> str:
    """Let every packed layer product take the packed kernel up to `rows` rows (the crossover measured at
    load moves with the host's load: a busy CI host may measure a tiny model's dense GEMM as faster from
    2 rows on) and decide the decode path again; returns its load line."""
    from pagedserve.model.llama import FusedDecode
    from pagedserve.model.quant import PackedWeight
    for layer in model.layers:
        for product in FusedDecode.PRODUCTS:
            w = getattr(getattr(layer, f"{product}_proj", None), "weight", None)
            if isinstance(w, PackedWeight):
                w.small_m = rows
    return model.choose_decode_path()


def assert_idle(llm) -> None:
    """Nothing held by any request, every KV block back in the pool."""
    held = {k: v for k, v in llm.engine.held().items() if v}
    assert not held, held
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.pool.num_usable_blocks
