"""A GGUF's packed matrices read only where needed (pagedserve/model/gguf_packed.py, issues 51 and 56): a
load that misses the packed cache makes each packed tensor from the mapped file exactly once; a load that
hits it reads none of them; both give the same tokens and logprobs, in float32 and with default flags."""
from __future__ import annotations

import pytest
import torch

from pagedserve.model import gguf_packed, loader, packed_cache
from pagedserve.model.loader import load_model, resolve_model
from pagedserve.model.quant import Deferred, PackedParts, packed_weights
from tests.model.gguf_mixes import write_mix
from tests.model.test_gguf_mixes import _default_path, _greedy, _logits

SETTINGS = {"float32": dict(dtype=torch.float32, quantization="gguf"), "default": _default_path()}
PROMPT = list(range(3, 30))


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    monkeypatch.setattr(packed_cache, "cache_root", lambda: str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDSERVE_INTERLEAVE", raising=False)
    path = tmp_path / "mix.gguf"
    write_mix(str(path), "llama", "Q4_K_M")      # K-quants, Q5_0 rewritten to Q8_0, q/k permuted, mixed parts
    return str(path)


def _load(path: str, settings: dict, monkeypatch) -> tuple:
    """A fresh load (not the process's shared copy), and the packed tensors it read from the file, in order."""
    monkeypatch.setattr(loader, "_LOADED", {})
    read: list[str] = []
    real = loader.packed_matrix

    def counted(t, spans):
        w = real(t, spans)
        make = w.deferred.make
        w.deferred = Deferred(lambda: read.append(t.name) or make(), w.deferred.five_bits)
        return w
    monkeypatch.setattr(loader, "packed_matrix", counted)
    model, cfg = load_model(resolve_model(path), **settings)
    monkeypatch.setattr(loader, "packed_matrix", real)
    return model, cfg, read


def _outputs(model, cfg) -> tuple[list[int], torch.Tensor]:
    return _greedy(model, cfg, PROMPT, 8), torch.log_softmax(_logits(model, cfg, PROMPT), -1)


@pytest.mark.parametrize("which", list(SETTINGS))
def test_a_hit_reads_no_packed_tensor_and_answers_as_the_miss(gguf_file, monkeypatch, which):
    miss, cfg, read_on_miss = _load(gguf_file, SETTINGS[which], monkeypatch)
    leaves = [p for w in packed_weights(miss) for p in (w.parts if isinstance(w, PackedParts) else [w])]
    assert leaves and all(p.deferred is None and not p.data.is_meta for p in leaves)
    assert read_on_miss and len(read_on_miss) == len(set(read_on_miss))     # each packed tensor read once
    hit, _, read_on_hit = _load(gguf_file, SETTINGS[which], monkeypatch)
    assert read_on_hit == []
    assert hit is not miss
    tokens, logprobs = _outputs(miss, cfg)
    hit_tokens, hit_logprobs = _outputs(hit, cfg)
    assert hit_tokens == tokens
    assert torch.equal(hit_logprobs, logprobs)


def test_a_miss_gives_back_the_file_pages_it_read(gguf_file, monkeypatch):
    """Each weight's pages are given back once it is made (never the spans of tensors not yet read)."""
    released: list[list[tuple[int, int]]] = []
    real = gguf_packed.FileSpans.release

    def spy(self):
        released.append(list(self.read))
        real(self)
    monkeypatch.setattr(gguf_packed.FileSpans, "release", spy)
    _, _, read = _load(gguf_file, SETTINGS["default"], monkeypatch)
    spans = [s for batch in released for s in batch]
    assert 0 < len(released) <= len(read) and len(spans) == len(read) == len(set(spans))
