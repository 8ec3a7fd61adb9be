"""pagedserve/disk_cache.py: a cache folder pruned to its budget, least recently used first; the entry just
written kept whatever its size; a writer's fresh temporary file left alone, an old one removed; folders
(the weights cache's entries) counted whole; a bad budget named."""
from __future__ import annotations

import os
import time

import pytest

from pagedserve import disk_cache


def _entry(folder, name, size, age_s, is_dir=False):
    path = os.path.join(folder, name)
    if is_dir:
        os.makedirs(path)
        for i in range(2):
            with open(os.path.join(path, f"part{i}"), "wb") as f:
                f.write(b"x" * (size // 2))
    else:
        with open(path, "wb") as f:
            f.write(b"x" * size)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_oldest_use_goes_first_until_the_rest_fit(tmp_path):
    old = _entry(tmp_path, "old", 1000, 300)
    mid = _entry(tmp_path, "mid", 1000, 200, is_dir=True)
    new = _entry(tmp_path, "new", 1000, 100)
    keep = _entry(tmp_path, "just-written", 1000, 0)
    removed = disk_cache.prune(str(tmp_path), keep=keep, budget=2500)
    assert removed == [old, mid]
    assert sorted(os.listdir(tmp_path)) == ["just-written", "new"]


def test_a_use_makes_an_entry_young(tmp_path):
    old = _entry(tmp_path, "old", 1000, 300)
    mid = _entry(tmp_path, "mid", 1000, 200)
    disk_cache.used(old)
    keep = _entry(tmp_path, "keep", 1000, 0)
    assert disk_cache.prune(str(tmp_path), keep=keep, budget=2000) == [mid]


def test_the_kept_entry_stays_over_any_budget(tmp_path):
    keep = _entry(tmp_path, "big", 5000, 500)
    other = _entry(tmp_path, "other", 10, 0)
    assert disk_cache.prune(str(tmp_path), keep=keep, budget=0) == [other]
    assert os.listdir(tmp_path) == ["big"]


def test_temporary_files_of_live_writers_stay_and_debris_goes(tmp_path):
    live = _entry(tmp_path, "x.safetensors.123.tmp", 1000, 10)
    debris = _entry(tmp_path, "y.safetensors.456.tmp", 1000, 2 * disk_cache.TMP_GRACE_S)
    keep = _entry(tmp_path, "keep", 10, 0)
    assert disk_cache.prune(str(tmp_path), keep=keep, budget=0) == [debris]
    assert os.path.exists(live)


def test_a_missing_folder_is_a_warning(tmp_path, caplog):
    assert disk_cache.prune(str(tmp_path / "absent"), keep="") == []
    assert "not pruned" in caplog.text


@pytest.mark.parametrize("raw", ["lots", "-1"])
def test_a_bad_budget_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("PAGEDSERVE_CACHE_MAX_GB", raw)
    with pytest.raises(ValueError, match="PAGEDSERVE_CACHE_MAX_GB"):
        disk_cache.budget_bytes()


def test_the_budget_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CACHE_MAX_GB", raising=False)
    assert disk_cache.budget_bytes() == int(disk_cache.DEFAULT_BUDGET_GB * 2**30)
    monkeypatch.setenv("PAGEDSERVE_CACHE_MAX_GB", "0.5")
    assert disk_cache.budget_bytes() == 2**29


def test_the_dequantized_weights_cache_is_pruned_too(tmp_path, monkeypatch):
    """loader._read_gguf_cached (--quantization none / float32 on a GGUF): one folder per model file; with a
    budget of 0 the second file's entry replaces the first's, and a hit on it still reads."""
    import torch
    from pagedserve.model import loader, source
    from tests.model.gguf_mixes import write_mix
    monkeypatch.setattr(source, "cache_root", lambda: str(tmp_path / "cache"))    # (cache_dir lives there)
    monkeypatch.setenv("PAGEDSERVE_CACHE_MAX_GB", "0")
    files = [str(tmp_path / f"m{i}.gguf") for i in range(2)]
    for i, f in enumerate(files):
        write_mix(f, "llama", "Q4_K_M", seed=i)
    folder = tmp_path / "cache" / "weights"
    first = loader._read_gguf_cached(files[0], torch.float32)[1]
    assert len(os.listdir(folder)) == 1
    loader._read_gguf_cached(files[1], torch.float32)
    (entry,) = os.listdir(folder)
    assert entry == os.path.basename(loader.cache_dir(files[1], "weights"))
    again = loader._read_gguf_cached(files[0], torch.float32)[1]     # rebuilt, the same tensors
    assert all(torch.equal(first[k], again[k]) for k in first)
