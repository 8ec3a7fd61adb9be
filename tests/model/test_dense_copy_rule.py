"""Which packed weights get a dense copy under --quantization auto (quant.dense_copy_plan, issue 51 item 3): a
fixed rule by the model's size and each weight's role, the same for every tensor type; a weight without a copy
multiplies packed up to uncopied_rows (prompt rows too) and dequantizes tiles above, equal to the dequantized
file's product; and a model without copies answers the same greedy tokens on two starts (two processes)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.core.request import Request
from pagedserve.core.step import ScheduledSeq, SchedulerOutput
from pagedserve.model import loader, packed_cache, quant
from pagedserve.model.loader import load_model, resolve_model
from pagedserve.model.quant import AS_Q8_0, PackedEmbedding, PackedWeight, as_q8_0, packed_weights, q8_round
from pagedserve.runner.model_runner import ModelRunner
from pagedserve.sampling_params import SamplingParams
from tests.model import gguf_mixes
from tests.model.gguf_mixes import random_blocks, write_mix
from tests.model.helpers import group_tables

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "IQ4_NL"]     # the kernels' types and the rewritten ones
LOAD = dict(dtype=torch.bfloat16, quantization="gguf", int8_act=True, dense_copy=True)   # --quantization auto's


def _one_type_file(path, qtype: str, monkeypatch) -> str:
    """A 3-layer Llama-shaped GGUF file (256 wide: every type's blocks divide its rows) whose every matrix,
    the untied embedding and LM head too, is `qtype`."""
    monkeypatch.setitem(gguf_mixes.RECIPES, f"all-{qtype}", dict(base=qtype, more=qtype, output=qtype, embd=qtype))
    write_mix(str(path), "llama", f"all-{qtype}")
    return str(path)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Loads that neither share the process's copy nor read another test's packed-cache entry."""
    monkeypatch.setattr(loader, "_LOADED", {})
    monkeypatch.setattr(packed_cache, "cache_root", lambda: str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDSERVE_PACKED_ROWS", raising=False)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_rule_copies_a_small_models_products_and_no_larger_models(tmp_path, monkeypatch, caplog, fresh, qtype):
    path = _one_type_file(tmp_path / f"{qtype}.gguf", qtype, monkeypatch)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        model, _ = load_model(resolve_model(path), **LOAD)
    ws = packed_weights(model)
    emb = model.embed_tokens.weight
    assert isinstance(model.embed_tokens, PackedEmbedding) and len(ws) == 3 * 4 + 2
    products = [w for w in ws if w is not emb]
    need = sum(w.shape[0] * w.K for w in products) * 2
    assert all(w.dense is not None for w in products) and emb.dense is None      # lookups need no copy
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("dense copies"))
    assert line.startswith(f"dense copies: 13 of 14 packed weights, {need / 2**20:.0f} MiB in bfloat16 (")
    assert "1 embedding lookups without" in line
    rows, head_rows, _ = quant.packed_rows(True)
    assert model.head_weight.small_m == head_rows
    assert {m.weight.small_m for layer in model.layers for m in layer.products()} == {rows}

    # the same file in a model that would need more than the limit's bytes: no copies, packed to uncopied_rows
    monkeypatch.setattr(quant, "DENSE_COPY_MODEL_BYTES", need - 1)
    monkeypatch.setattr(loader, "_LOADED", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        model, _ = load_model(resolve_model(path), **LOAD)
    ws = packed_weights(model)
    assert all(w.dense is None for w in ws)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("dense copies"))
    assert line.startswith("dense copies: 0 of 14 packed weights, 0 MiB (") and f"above the {(need - 1) / 2**20:.0f} MiB" in line
    bare = max(rows, quant.uncopied_rows(True))
    assert {w.small_m for w in ws if w is not model.embed_tokens.weight} == {bare}
    assert "prompt rows too" in caplog.text


def test_the_rule_as_a_function_of_size_role_and_memory():
    """dense_copy_plan by itself: under the limit every product's weight (a tied embedding is the LM head's,
    so it is one), never a lookup-only embedding; over the limit or over the free-memory share, none."""
    rng = np.random.default_rng(0)
    w = PackedWeight("Q4_1", torch.from_numpy(random_blocks("Q4_1", 64, 256, rng)), 256)
    e = PackedWeight("Q8_0", torch.from_numpy(random_blocks("Q8_0", 32, 256, rng)), 256)
    model = torch.nn.ModuleDict({"a": quant.PackedLinear(w), "emb": PackedEmbedding(e, torch.float32)})
    need = 64 * 256 * 4
    copied, line = quant.dense_copy_plan(model, torch.float32, free_bytes=1 << 40, limit_bytes=need)
    assert copied == [w] and line.startswith("dense copies: 1 of 2 packed weights, 0 MiB in float32")
    assert quant.dense_copy_plan(model, torch.float32, free_bytes=1 << 40, limit_bytes=need - 1)[0] == []
    copied, line = quant.dense_copy_plan(model, torch.float32, free_bytes=2 * need - 1, limit_bytes=need)
    assert copied == [] and "50% of" in line
    model.head_weight = e                                   # a tied LM head: the embedding is a product too
    assert quant.dense_copy_plan(model, torch.float32, free_bytes=1 << 40, limit_bytes=1 << 30)[0] == [w, e]


def _packed(qtype: str, n: int, k: int, seed: int) -> PackedWeight:
    raw = torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(seed)))
    return PackedWeight("Q8_0", as_q8_0(qtype, raw, k), k) if qtype in AS_Q8_0 else PackedWeight(qtype, raw, k)


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "tiles"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["file-layout", "interleaved"])
@pytest.mark.parametrize("qtype", TYPES)
def test_a_weight_without_a_copy_is_the_dequantized_product_at_every_row_count(monkeypatch, qtype, interleaved, whole):
    """Above small_m: the matrix dequantized whole into a reused buffer, or (above WHOLE_WEIGHTS) by tiles (several
    here, the last one short), and the GEMM, equal to the dequantized matrix's product (float32 x); up to small_m,
    prompt rows too: the packed kernel on int8-rounded x."""
    if not whole:
        monkeypatch.setattr(quant, "WHOLE_WEIGHTS", 0)
    w = _packed(qtype, 72, 512, 1)
    ref_w = w.dequantize(torch.float32)
    w.int8_act, w.small_m = True, 8
    if interleaved:
        w.interleave()
        assert w.grouped
    monkeypatch.setattr(quant, "TILE_WEIGHTS", 16 * w.K)      # 16-row tiles: 72 rows = 4 whole and a short one
    torch.testing.assert_close(w.dequantize(torch.float32), ref_w, rtol=0, atol=0)
    x = torch.randn(40, w.K, generator=torch.Generator().manual_seed(2))
    ref = F.linear(x.double(), ref_w.double()).float()
    tol = 1e-5 * ref.abs().max().item()
    torch.testing.assert_close(w.matmul(x), ref, rtol=1e-5, atol=tol)
    torch.testing.assert_close(w.matmul(x, prompt=True), ref, rtol=1e-5, atol=tol)
    got = w.matmul(x.bfloat16()).float()                      # the bf16 GEMM on bf16 tiles
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    few = x[:8]
    packed = w.matmul(few, prompt=True)                       # no copy: a prompt's rows take the kernel too
    torch.testing.assert_close(packed, w._qmatmul(few, True), rtol=0, atol=0)
    ref8 = F.linear(q8_round(few).double(), ref_w.double()).float()
    torch.testing.assert_close(packed, ref8, rtol=1e-4, atol=1e-4 * ref8.abs().max().item())


GREEDY_STEPS = 6
PROMPTS = [[(7 * i + 13 * j) % 500 + 5 for j in range(90 + 10 * i)] for i in range(4)]    # 420 rows in one step


def greedy_without_copies(path: str, cache: str) -> dict:
    """The model loaded with --quantization auto's settings but no copies (the limit at 0 bytes): four prompts
    prefilled in one step of 420 rows (above every host's uncopied_rows: tiles), then GREEDY_STEPS decode steps
    of 4 rows (packed); the tokens and their logprobs, and how many products took tiles."""
    quant.DENSE_COPY_MODEL_BYTES = 0
    # the 420-row prompt step above uncopied_rows on every host kind (Zen 4's table packs 4,096 rows): tiles
    quant.UNCOPIED_ROWS = {k: min(v, 256) for k, v in quant.UNCOPIED_ROWS.items()}
    packed_cache.cache_root = lambda: cache         # a test's own folder (the second start reads the first's entry)
    model, cfg = load_model(resolve_model(path), **LOAD)
    assert all(w.dense is None for w in packed_weights(model))
    tiles = []
    real = quant.PackedWeight._dense_matmul
    quant.PackedWeight._dense_matmul = lambda self, x, b: tiles.append(x.shape[0]) or real(self, x, b)
    try:
        runner = ModelRunner(model, num_blocks=1 + 4 * 8 * cfg.kv_layout.num_groups, block_size=16)
        reqs = [Request(f"r{i}", list(p), SamplingParams(max_tokens=GREEDY_STEPS, temperature=0.0, logprobs=0),
                        max_tokens=GREEDY_STEPS) for i, p in enumerate(PROMPTS)]
        tables = [group_tables(runner, list(range(1 + 8 * i, 9 + 8 * i))) for i in range(4)]
        todo = [(r, 0, len(r.all_token_ids)) for r in reqs]
        logprobs: dict[str, list[float]] = {r.request_id: [] for r in reqs}
        for _ in range(GREEDY_STEPS):
            out = runner.execute(SchedulerOutput(seqs=tuple(ScheduledSeq.of(r, s, n, t, True)
                                                            for (r, s, n), t in zip(todo, tables))))
            for r in reqs:
                tok = out.sampled[r.request_id][0]
                r.append_token(tok.token_id)
                logprobs[r.request_id].append(tok.logprobs[tok.token_id].logprob)
            todo = [(r, len(r.all_token_ids) - 1, 1) for r in reqs]
    finally:
        quant.PackedWeight._dense_matmul = real
    return {"tokens": [r.output_token_ids for r in reqs], "logprobs": [logprobs[r.request_id] for r in reqs],
            "tile_rows": sorted(set(tiles))}


def test_without_copies_the_same_greedy_tokens_on_two_starts(tmp_path, monkeypatch, fresh):
    path = str(tmp_path / "mix.gguf")
    write_mix(path, "llama", "Q4_K_M")
    monkeypatch.setattr(quant, "DENSE_COPY_MODEL_BYTES", quant.DENSE_COPY_MODEL_BYTES)   # restored after
    monkeypatch.setattr(quant, "UNCOPIED_ROWS", quant.UNCOPIED_ROWS)
    cache = str(tmp_path / "cache")
    here = json.loads(json.dumps(greedy_without_copies(path, cache)))     # through JSON, as the other start's floats
    assert os.listdir(os.path.join(cache, "packed"))                      # the entry the second start reads
    script = ("import json, sys; from tests.model.test_dense_copy_rule import greedy_without_copies; "
              "print(json.dumps(greedy_without_copies(sys.argv[1], sys.argv[2])))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop("PAGEDSERVE_PACKED_ROWS", None)
    out = subprocess.run([sys.executable, "-c", script, path, cache], capture_output=True, text=True, env=env, cwd=root,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert here["tile_rows"] == [sum(map(len, PROMPTS))]            # the prefill step took tiles, decode steps not
    assert all(len(t) == GREEDY_STEPS for t in here["tokens"])
    assert here["tokens"] == there["tokens"] and here["logprobs"] == there["logprobs"]
