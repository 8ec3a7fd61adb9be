"""The GGUF files people download mix tensor types (llama-quantize's Q4_K_M gives attn_v and ffn_down
Q6_K in some layers, falls back to Q5_0 / Q8_0 where a row does not divide into 256): every such file
loads with default flags, its products stay packed where a kernel (or a lossless rewrite) reads the
type, fused projections whose parts differ stay packed part by part, and the arithmetic is the
dequantized file's (float32) or close to it (the default path, int8-rounded activations)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.core.request import Request
from pagedserve.core.scheduler import ScheduledSeq, SchedulerOutput
from pagedserve.host import auto_dtype
from pagedserve.model import loader, quant
from pagedserve.model.loader import ModelLoadError, load_model, resolve_model
from pagedserve.model.quant import Packed, PackedParts, PackedWeight, as_q8_0, stack_rows
from pagedserve.runner.model_runner import ModelRunner
from pagedserve.sampling_params import SamplingParams
from tests.model.gguf_mixes import RECIPES, SHAPES, VOCAB, random_blocks, write_mix
from tests.model.helpers import blocks_for, forward_all_rows, group_tables, make_request

LEVELS = kernels.host_levels()


@pytest.fixture(params=LEVELS)
def level(request, monkeypatch):
    lib = kernels.load(request.param, source="qmatmul")
    monkeypatch.setattr(quant, "_lib", lambda: lib)
    return request.param


@pytest.mark.parametrize("fmt", ["Q5_0", "IQ4_NL"])
def test_rewritten_as_q8_0_blocks_without_loss(fmt):
    """Q5_0 and IQ4_NL blocks are d times small integers: as Q8_0 blocks they dequantize to exactly what
    the gguf package dequantizes the file's bytes to."""
    rng = np.random.default_rng(3)
    for n in (13, 45_001):                           # odd rows, 3 blocks a row; past one slice of the rewrite
        raw = random_blocks(fmt, n, 96, rng)
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).astype(np.float32)
        w = PackedWeight("Q8_0", as_q8_0(fmt, torch.from_numpy(raw), 96), 96)
        assert torch.equal(w.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_q5_0_rows_interleave_as_q5_0x8(level, m):
    """A Q5_0 file's rows (Q8_0 blocks after the load's rewrite, their quants in [-16, 15]) regroup as
    Q5_0x8 for int8 activations: 5.5 bits a weight read, the same products as the Q8_0 rows' (integer sums,
    the same scales) and the same rows back from dequantize. 72 rows: a 16-row work item and a last one of 8.
    A Q8_0 matrix with a quant outside 5 bits keeps Q8_0x8."""
    n, k = 72, 768
    raw = torch.from_numpy(random_blocks("Q5_0", n, k, np.random.default_rng(m)))
    rows_w = PackedWeight("Q8_0", as_q8_0("Q5_0", raw, k), k, int8_act=True)
    w = PackedWeight("Q8_0", rows_w.data.clone(), k, int8_act=True)
    w.interleave()
    assert w.fmt == "Q5_0x8" and w.data.shape == raw.shape
    dense = rows_w.dequantize()
    assert torch.equal(w.dequantize(), dense)
    ids = torch.tensor([5, 0, 71, 5, 8, 63])
    assert torch.equal(w.dequantize(rows=ids), dense[ids])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = F.linear(quant.q8_round(x).double(), dense.double())
    got = w._qmatmul(x, int8_act=True)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    torch.testing.assert_close(got, rows_w._qmatmul(x, int8_act=True), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    wide = PackedWeight("Q8_0", rows_w.data.clone(), k, int8_act=True)
    wide.data[3, 2] = 100                                     # one quant outside [-16, 15]
    wide.interleave()
    assert wide.fmt == "Q8_0x8"


def _parts(seed: int = 0) -> list[PackedWeight]:
    rng = np.random.default_rng(seed)
    return [PackedWeight(f, torch.from_numpy(random_blocks(f, n, 512, rng)), 512)
            for f, n in (("Q4_K", 64), ("Q4_K", 16), ("Q6_K", 24), ("Q8_0", 8))]


def test_stack_rows_keeps_one_format_as_one_weight_and_a_mix_as_parts():
    ps = _parts()
    one = stack_rows(ps[:2])
    assert isinstance(one, PackedWeight) and one.fmt == "Q4_K" and one.shape == (80, 512)
    mix = stack_rows(ps)
    assert isinstance(mix, PackedParts) and [p.fmt for p in mix.parts] == ["Q4_K", "Q6_K", "Q8_0"]
    assert mix.shape == (112, 512) and mix.fmt == "Q4_K+Q6_K+Q8_0"
    assert torch.equal(mix.dequantize(), torch.cat([p.dequantize() for p in ps]))
    q5 = PackedWeight("Q8_0", as_q8_0("Q5_0", torch.from_numpy(random_blocks("Q5_0", 16, 512, np.random.default_rng(1))),
                                     512), 512)
    split = stack_rows([q5, q5, ps[3]])      # a Q5_0 file's q|k beside a Q8_0 v: two runs, q|k regroups as Q5_0x8
    assert isinstance(split, PackedParts) and [p.shape[0] for p in split.parts] == [32, 8]
    split.interleave()
    assert [p.fmt for p in split.parts] == ["Q5_0x8", "Q8_0x8"]
    with pytest.raises(ValueError, match="one K"):
        PackedParts([ps[0], PackedWeight("Q8_0", torch.zeros(8, 34 * 8, dtype=torch.uint8), 256)])


@pytest.mark.parametrize("int8_act", [False, True])
@pytest.mark.parametrize("m", [1, 3, 13, 40])
def test_parts_multiply_as_the_dequantized_matrix(level, m, int8_act):
    """Each part by its own kernel into its columns (the file's rows, or regrouped by 8 for int8
    activations); above small_m the dense copy or part-by-part dequantized tiles; bias over all columns."""
    w = stack_rows(_parts(m))
    dense = w.dequantize()
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    b = torch.randn(dense.shape[0])
    ref = F.linear((quant.q8_round(x) if int8_act else x).double(), dense.double(), b.double()).float()
    w.int8_act, w.small_m = int8_act, 16
    if int8_act:
        w.interleave()
        assert [p.fmt for p in w.parts] == ["Q4_Kx8", "Q6_Kx8", "Q8_0x8"]
    got = w.matmul(x, b)
    tol = 1e-4 * ref.abs().max().item()
    if m > 16:      # the many-row path: float x (no int8 rounding) against the dequantized matrix
        ref = F.linear(x.double(), dense.double(), b.double()).float()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=tol)
    w.dense = dense.bfloat16()
    if m > 16:
        got = w.matmul(x, b.bfloat16()).float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def _default_path() -> dict:
    """What `pagedserve` with default flags loads a GGUF file as (engine/core.py's choices)."""
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[auto_dtype("cpu")[0]]
    q, dense_copy, _ = quant.choose_quantization("auto", "gguf", "auto", "cpu", 1)
    int8_act, _ = quant.int8_activations("auto", q)
    return dict(dtype=dtype, quantization=q, int8_act=int8_act, dense_copy=dense_copy)


def _greedy(model, cfg, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens through the runner's own step path (a prefill, then decode steps: the fused
    native call where the model takes it)."""
    runner = ModelRunner(model, num_blocks=20 * cfg.kv_layout.num_groups, block_size=16)
    req = Request("r", list(prompt), SamplingParams(max_tokens=n, temperature=0.0), max_tokens=n)
    blocks, start, size = group_tables(runner, list(range(1, 20))), 0, len(prompt)
    for _ in range(n):
        out = runner.execute(SchedulerOutput(seqs=(ScheduledSeq.of(req, start, size, blocks, True),)))
        req.append_token(out.sampled["r"][0].token_id)
        start, size = start + size, 1
    return req.output_token_ids


def _logits(model, cfg, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, num_blocks=1 + 20 * cfg.kv_layout.num_groups, block_size=16)
    return forward_all_rows(runner, [(make_request("a", ids), 0, len(ids), blocks_for(1, len(ids), 16))]).float()


CASES = [(a, r) for a in SHAPES for r in RECIPES]


@pytest.mark.parametrize("arch,recipe", CASES, ids=[f"{a}-{r}" for a, r in CASES])
def test_mixed_file_loads_with_default_flags_packed_and_close(tmp_path, monkeypatch, arch, recipe):
    monkeypatch.setattr(loader, "_LOADED", {})
    path = str(tmp_path / f"{arch}-{recipe}.gguf")
    types = write_mix(path, arch, recipe)
    src = resolve_model(path)
    # 1. default flags: loads; every projection whose type a kernel reads (or Q5_0 / IQ4_NL rewritten) is packed
    model, cfg = load_model(src, **_default_path())
    kernel_types = set(quant.FORMATS) | set(quant.AS_Q8_0)
    for i in range(cfg.num_layers):
        layer = model.layers[i]
        for prod, names in (("qkv_proj", ("attn_q", "attn_k", "attn_v")), ("o_proj", ("attn_output",)),
                            ("gate_up_proj", ("ffn_gate", "ffn_up")), ("down_proj", ("ffn_down",))):
            want = all(types[f"blk.{i}.{n}.weight"] in kernel_types for n in names)
            got = getattr(layer, prod).weight
            assert isinstance(got, Packed) == want, (prod, i, [types[f"blk.{i}.{n}.weight"] for n in names])
            if want and len({types[f"blk.{i}.{n}.weight"] for n in names}) > 1:
                assert isinstance(got, PackedParts)
    prompts = [list(range(3, 11)), [int(t) for t in torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1))]]
    # 2. packed in float32 (no int8 rounding) computes what the dequantized file computes
    monkeypatch.setattr(loader, "_LOADED", {})
    exact, _ = load_model(src, dtype=torch.float32, quantization="gguf")
    monkeypatch.setattr(loader, "_LOADED", {})
    dense, _ = load_model(src, dtype=torch.float32, quantization="none")
    a, b = _logits(exact, cfg, prompts[1]), _logits(dense, cfg, prompts[1])
    assert (a - b).abs().max().item() < 1e-4 * max(1.0, b.abs().max().item())
    # 3. the default path's greedy tokens by the closeness rule: equal, or at the first difference each
    # token in the other's top-5 (tests/engine/test_kv_cache_dtype.py)
    for p in prompts:
        ours = _greedy(model, cfg, p, 12)
        ref = _greedy(dense, cfg, p, 12)
        if ours == ref:
            continue
        i = next(j for j, (x, y) in enumerate(zip(ours, ref)) if x != y)
        lo, lr = _logits(model, cfg, p + ours[:i]), _logits(dense, cfg, p + ref[:i])
        assert ours[i] in lr[-1].topk(5).indices.tolist() and ref[i] in lo[-1].topk(5).indices.tolist(), (p, i)


def test_fused_decode_takes_mixed_parts(tmp_path, monkeypatch):
    """A Q4_K_M Llama (v rows Q6_K in some layers): decode steps run every layer in one native call with
    the parts chained (packed_t.next), and give the layer path's tokens (float32, float activations)."""
    monkeypatch.setattr(loader, "_LOADED", {})
    path = str(tmp_path / "llama.gguf")
    write_mix(path, "llama", "Q4_K_M")
    model, cfg = load_model(resolve_model(path), dtype=torch.float32, quantization="gguf")
    assert model.fused is not None
    assert any(isinstance(layer.qkv_proj.weight, PackedParts) for layer in model.layers)
    fused = _greedy(model, cfg, list(range(5, 30)), 10)
    monkeypatch.setattr(model, "fused", None)
    assert _greedy(model, cfg, list(range(5, 30)), 10) == fused


def test_truncated_file_is_a_load_error(tmp_path):
    path = tmp_path / "whole.gguf"
    write_mix(str(path), "llama", "Q4_K_M")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cut.gguf.*tensor blk\.\d+\.\w+\.weight needs bytes up to \d+, but the file"):
        load_model(resolve_model(str(cut)))


def test_shape_disagreeing_with_metadata_names_the_tensor(tmp_path, monkeypatch):
    """A file whose metadata says 4 heads of 64 but whose q rows are 128: refused at load naming the tensor."""
    import tests.model.gguf_mixes as mixes
    monkeypatch.setitem(mixes.SHAPES, "llama", dict(mixes.SHAPES["llama"], heads=2))
    path = tmp_path / "bad.gguf"
    write_mix(str(path), "llama", "Q6_K")
    monkeypatch.undo()
    # rewrite the head count the metadata states (2 -> 4): the tensors keep 2 heads' rows
    reader = gguf.GGUFReader(str(path), "r+")
    reader.fields["llama.attention.head_count"].parts[-1][0] = 4
    reader.data.flush()
    del reader
    monkeypatch.setattr(loader, "_LOADED", {})
    with pytest.raises(ModelLoadError, match=r"layers\.0\.qkv_proj.*shape"):
        load_model(resolve_model(str(path)), quantization="gguf")


def test_span_reader_reads_what_ggufs_reader_reads(tmp_path):
    """The loader's reader (arrays read as one span: a tokenizer's vocabulary took seconds element by
    element) gives gguf's scalars, strings and tensors, and each array's length."""
    path = tmp_path / "m.gguf"
    write_mix(str(path), "qwen2", "Q4_K_M")
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_block_count(2)
    w.add_token_list([f"tok{i}é" for i in range(300)])
    w.add_token_types([1] * 300)
    w.add_token_scores([0.5] * 300)
    w.add_string("general.name", "tiny")
    w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, tmp_path / "t.gguf"):
        ours, theirs = loader.gguf_reader(str(p)), gguf.GGUFReader(str(p))
        assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
            [(t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
        for key, f in theirs.fields.items():
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                assert loader.gguf_array_len(ours, key) == len(f.data), key
            else:
                assert loader.gguf_field(ours, key) == f.contents(), key
    assert loader.gguf_array_len(loader.gguf_reader(str(tmp_path / "t.gguf")), "tokenizer.ggml.tokens") == 300
