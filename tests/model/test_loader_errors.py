"""A missing or unreadable model gives one clear error saying what was looked for."""
import numpy as np
import pytest

from pagedserve.model.loader import ModelLoadError, load_model, resolve_model


def test_missing_path():
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("/nonexistent/model.gguf")


def test_folder_without_model(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path))


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(resolve_model(str(f)))


def test_unsupported_quantization(tmp_path):
    import gguf
    f = tmp_path / "iq.gguf"          # (IQ2_XXS: a type no recipe of the common ones writes, not read here)
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_context_length(128)
    qt = gguf.GGMLQuantizationType.IQ2_XXS
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    w.add_tensor("token_embd.weight", np.zeros((8, 256 // block * nbytes), dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF quantization type IQ2_XXS for tensor token_embd"):
        load_model(resolve_model(str(f)))


def test_default_model_is_found():
    src = resolve_model(None)
    assert src.kind == "gguf" and src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_types_round_trip(qtype):
    """Each supported type dequantizes to within its quantization error of the original."""
    import gguf
    from gguf import quants
    qt = gguf.GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    if qtype == "F16":
        q = x.astype(np.float16).view(np.uint8)
    else:
        q = quants.quantize(x, qt)
    from pagedserve.model.loader import _dequantize

    class T:  # the two fields of a GGUFReader tensor that _dequantize reads
        data, tensor_type = q, qt
    y = _dequantize(T)
    tol = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q6_K": 6e-2, "Q5_K": 0.12, "Q4_K": 0.25}.get(qtype, 0.3)
    assert y.shape == x.shape and np.abs(y - x).max() < tol


class _T:
    def __init__(self, data, qt):
        self.data, self.tensor_type = data, qt


def test_dequantize_q4_k_block_by_hand():
    """One Q4_K super-block built by hand: d=1, dmin=0, every sub-block scale 1 and min 0, nibbles 2 and 5."""
    import gguf
    from pagedserve.model.loader import _dequantize
    d = np.array([1.0, 0.0], dtype=np.float16).view(np.uint8)
    scales = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
    qs = np.full(128, 0x52, dtype=np.uint8)
    block = np.concatenate([d, scales, qs])[None, :]
    y = _dequantize(_T(block, gguf.GGMLQuantizationType.Q4_K))
    assert y.shape == (1, 256)
    assert y[0].tolist() == ([2.0] * 32 + [5.0] * 32) * 4


@pytest.mark.parametrize("qtype", ["Q5_K", "Q6_K", "Q4_K"])
def test_dequantize_k_quant_shapes(qtype):
    import gguf
    from pagedserve.model.loader import _dequantize
    qt = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((3, 2 * nbytes), dtype=np.uint8)      # all scales zero: every weight is exactly 0
    y = _dequantize(_T(raw, qt))
    assert y.shape == (3, 2 * block) and y.dtype == np.float32 and not y.any()


def test_an_accelerators_model_is_shared_while_an_engine_holds_it_and_freed_after(tmp_path, monkeypatch):
    """Engines in one process share one loaded copy; on an accelerator (held_for_the_process false:
    played here on the CPU) the copy goes with the last engine that holds it, where on the CPU it stays."""
    import gc
    import weakref
    from pagedserve import LLM, SamplingParams
    from pagedserve.model import loader
    from tests.model.families import save_family, tiny_tokenizer
    tok = tiny_tokenizer(512)
    save_family("llama", str(tmp_path), len(tok), tok)
    monkeypatch.setattr(loader, "_LOADED", {})
    monkeypatch.setattr(loader, "held_for_the_process", lambda device: False)
    a = LLM(str(tmp_path), num_kv_blocks=32)
    b = LLM(str(tmp_path), num_kv_blocks=32)
    assert a.engine.core.runner.model is b.engine.core.runner.model
    gone = weakref.ref(a.engine.core.runner.model)
    out = b.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    a.shutdown()
    b.shutdown()
    del a, b, out
    gc.collect()
    assert gone() is None
    c = LLM(str(tmp_path), num_kv_blocks=32)                 # loaded again, not a dead reference
    assert len(c.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids) == 2
    c.shutdown()
    monkeypatch.setattr(loader, "held_for_the_process", lambda device: True)
    monkeypatch.setattr(loader, "_LOADED", {})
    d = LLM(str(tmp_path), num_kv_blocks=32)
    kept = weakref.ref(d.engine.core.runner.model)
    d.shutdown()
    del d
    gc.collect()
    assert kept() is not None
