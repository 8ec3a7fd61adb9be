"""The packed-weight cache (pagedserve/model/packed_cache.py, issue 56): a second load reads the entry the
first wrote and ends with the same bytes; another host flag, model file or engine version makes another
entry (rebuilt, not reused); a truncated, garbled, other-key or wrong-shape entry is ignored and rebuilt;
a folder that cannot be written is a warning and the load still succeeds. A small Q4_K_M-mixed GGUF file
(tests/model/gguf_mixes.py: K-quants, Q5_0 rewritten to Q8_0, fused parts) keeps each load well under a
second."""
from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from pagedserve.model import loader, packed_cache
from pagedserve.model.loader import load_model, resolve_model
from pagedserve.model.quant import packed_weights
from tests.model.gguf_mixes import write_mix

SETTINGS = dict(dtype=torch.float32, quantization="gguf", int8_act=True, dense_copy=True)


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    # the entries' folder only (PAGEDSERVE_CACHE would move the native builds too: a gcc run per test)
    monkeypatch.setattr(packed_cache, "cache_root", lambda: str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDSERVE_INTERLEAVE", raising=False)
    path = tmp_path / "mix.gguf"
    write_mix(str(path), "llama", "Q4_K_M")
    return str(path)


def _load(path: str, monkeypatch) -> tuple[list, list[bool]]:
    """A fresh load (not the process's shared copy): its packed weights, and what restore answered."""
    monkeypatch.setattr(loader, "_LOADED", {})
    answers: list[bool] = []
    real = packed_cache.restore

    def spy(*a):
        answers.append(real(*a))
        return answers[-1]
    monkeypatch.setattr(packed_cache, "restore", spy)
    model, _ = load_model(resolve_model(path), **SETTINGS)
    monkeypatch.setattr(packed_cache, "restore", real)
    return packed_weights(model), answers


def _state(weights) -> list:
    """Every leaf's format and bytes and every dense copy (None: a weight without one), to compare loads by."""
    leaves = [p for w in weights for p in (w.parts if hasattr(w, "parts") else [w])]
    return [(p.fmt, p.data.clone()) for p in leaves] + [None if w.dense is None else w.dense.clone() for w in weights]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            assert x[0] == y[0] and torch.equal(x[1], y[1])
        else:
            assert (x is None and y is None) or torch.equal(x, y)


def _entries() -> list[str]:
    d = os.path.join(packed_cache.cache_root(), "packed")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_second_load_reads_the_entry_and_has_the_same_bytes(gguf_file, monkeypatch):
    first, answers = _load(gguf_file, monkeypatch)
    assert answers == [False] and len(_entries()) == 1
    assert any(p.fmt.endswith("x8") for w in first for p in (w.parts if hasattr(w, "parts") else [w]))
    assert [w.dense is None for w in first].count(True) == 1     # the untied embedding: lookups, no copy
    second, answers = _load(gguf_file, monkeypatch)
    assert answers == [True] and len(_entries()) == 1
    _assert_same(_state(first), _state(second))


@pytest.mark.parametrize("change", ["host flag", "model file", "engine version", "settings"])
def test_a_changed_key_builds_a_new_entry(gguf_file, monkeypatch, change):
    reference, _ = _load(gguf_file, monkeypatch)
    reference = _state(reference)
    if change == "host flag":
        flags = packed_cache.cpu_info()
        monkeypatch.setattr(packed_cache, "cpu_info", lambda: (flags[0], flags[1] | {"avx10_2"}))
    elif change == "model file":         # same bytes, a new mtime: the key's file hash changes
        st = os.stat(gguf_file)
        os.utime(gguf_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif change == "engine version":
        monkeypatch.setattr(packed_cache, "engine_version", lambda: "0.0.0+other")
    else:
        monkeypatch.setenv("PAGEDSERVE_INTERLEAVE", "0")
    weights, answers = _load(gguf_file, monkeypatch)
    assert answers == [False] and len(_entries()) == 2
    if change != "settings":            # rebuilt: the same bytes as the first load made
        _assert_same(reference, _state(weights))


def test_the_model_hash_reads_sampled_bytes(tmp_path):
    """A rewrite that keeps size and mtime but changes a sampled span gives another hash."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(3 * packed_cache.SAMPLE_BYTES))
    st = os.stat(path)
    before = packed_cache.model_file_hash(str(path))
    with open(path, "r+b") as f:
        f.seek(3 * packed_cache.SAMPLE_BYTES // 2)
        f.write(b"\x01")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert packed_cache.model_file_hash(str(path)) != before


def _other_key_entry(path: str, key: str) -> None:
    """A valid safetensors file under `key`'s name whose stored key is another version's."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    save_file(load_file(path), path, metadata={"key": key.replace(packed_cache.engine_version(), "0.0.0+old"),
                                               "fmts": meta["fmts"]})


def _wrong_shape_entry(path: str, key: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    t = load_file(path)
    t["data.0"] = t["data.0"][:-8].clone()
    save_file(t, path, metadata=meta)


DAMAGE = {
    "truncated": lambda path, key: open(path, "r+b").truncate(os.path.getsize(path) // 2),
    "garbage": lambda path, key: open(path, "wb").write(os.urandom(4096)),
    "empty": lambda path, key: open(path, "wb").close(),
    "another version's": _other_key_entry,
    "a wrong-shape tensor's": _wrong_shape_entry,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_ignored_and_rebuilt(gguf_file, monkeypatch, caplog, damage):
    reference, _ = _load(gguf_file, monkeypatch)
    reference = _state(reference)
    [name] = _entries()
    path = os.path.join(packed_cache.cache_root(), "packed", name)
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        key = f.metadata()["key"]
    assert packed_cache.entry_path(key) == path
    DAMAGE[damage](path, key)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        weights, answers = _load(gguf_file, monkeypatch)
    assert answers == [False]
    assert "ignored" in caplog.text and name in caplog.text
    _assert_same(reference, _state(weights))
    again, answers = _load(gguf_file, monkeypatch)         # the rebuilt entry is whole again
    assert answers == [True]
    _assert_same(reference, _state(again))


@pytest.mark.parametrize("why", ["not a folder", "full"])
def test_an_unwritable_cache_is_a_warning(gguf_file, tmp_path, monkeypatch, caplog, why):
    if why == "not a folder":           # (as root a read-only mode does not stop a write; a file in the way does)
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        monkeypatch.setattr(packed_cache, "cache_root", lambda: str(blocker / "cache"))
    else:
        import safetensors.torch

        def full(tensors, filename, metadata=None):
            open(filename, "wb").write(b"x")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(safetensors.torch, "save_file", full)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        weights, answers = _load(gguf_file, monkeypatch)
    assert answers == [False] and "not written" in caplog.text
    assert [w.dense is None for w in weights].count(True) == 1
    if why == "full":                   # no half-written file left behind
        assert [n for n in _entries() if n.endswith(".tmp")] == []



def test_the_folder_is_pruned_to_its_budget_oldest_use_first(gguf_file, monkeypatch):
    """Engine versions a, b, c as the keys, a budget of 2.5 entries: after a and b, a hit on a marks it used,
    so writing c removes b (the least recently used), not a; with a budget of 0 the entry just written
    stays alone."""
    version = {"v": "0.0.0+a"}
    monkeypatch.setattr(packed_cache, "engine_version", lambda: version["v"])
    folder = os.path.join(packed_cache.cache_root(), "packed")
    _load(gguf_file, monkeypatch)
    (a,) = _entries()
    monkeypatch.setenv("PAGEDSERVE_CACHE_MAX_GB", str(2.5 * os.path.getsize(os.path.join(folder, a)) / 2**30))
    version["v"] = "0.0.0+b"
    _load(gguf_file, monkeypatch)
    (b,) = set(_entries()) - {a}
    os.utime(os.path.join(folder, a), (1e9, 1e9))            # a older than b, whatever the clock's resolution
    os.utime(os.path.join(folder, b), (1e9 + 1, 1e9 + 1))
    version["v"] = "0.0.0+a"
    _, answers = _load(gguf_file, monkeypatch)
    assert answers == [True]                                   # a hit: a is now the most recently used
    version["v"] = "0.0.0+c"
    _, answers = _load(gguf_file, monkeypatch)
    assert answers == [False]
    (c,) = set(_entries()) - {a, b}
    assert set(_entries()) == {a, c}                           # b, the least recently used, went
    monkeypatch.setenv("PAGEDSERVE_CACHE_MAX_GB", "0")
    version["v"] = "0.0.0+d"
    _load(gguf_file, monkeypatch)
    assert len(_entries()) == 1 and _entries()[0] not in {a, b, c}
