"""Hub ids resolve through huggingface_hub against a Hub cache folder this test builds (the layout
huggingface_hub itself writes: models--ORG--NAME/refs/<rev> -> snapshots/<commit>/...), offline."""
from __future__ import annotations

import shutil

import pytest

from pagedserve.model.loader import ModelLoadError, load_model, resolve_model
from tests.model.families import save_family, write_gguf


def _snapshot(cache, repo: str, commit: str, refs=("main",)):
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "refs").mkdir(exist_ok=True)
    for r in refs:
        (root / "refs" / r).write_text(commit)
    return snap


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch, tokenizer):
    cache = tmp_path / "hf" / "hub"
    hf = save_family("qwen3", _snapshot(cache, "test-org/tiny-qwen3", "a" * 40), len(tokenizer), tokenizer,
                     head_dim=32)
    gguf_dir = _snapshot(cache, "test-org/tiny-qwen3-GGUF", "b" * 40, refs=("main", "v1"))
    write_gguf("qwen3", hf, gguf_dir / "tiny-qwen3-Q4_K_M.gguf")
    shutil.copy(gguf_dir / "tiny-qwen3-Q4_K_M.gguf", gguf_dir / "tiny-qwen3-Q8_0.gguf")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hf_repository_resolves_to_its_snapshot(hub_cache):
    src = resolve_model("test-org/tiny-qwen3")
    assert src.kind == "hf" and src.name == "test-org/tiny-qwen3"
    assert src.path.endswith("snapshots/" + "a" * 40)
    model, cfg = load_model(src)
    assert cfg.arch == "qwen3"


def test_gguf_repository_picks_the_file_by_quantization(hub_cache):
    assert resolve_model("test-org/tiny-qwen3-GGUF:Q8_0").path.endswith("tiny-qwen3-Q8_0.gguf")
    assert resolve_model("test-org/tiny-qwen3-GGUF").path.endswith("-Q4_K_M.gguf")    # llama.cpp's default
    assert resolve_model("test-org/tiny-qwen3-GGUF:q8_0", revision="v1").path.endswith("Q8_0.gguf")
    with pytest.raises(ModelLoadError, match="Q2_K"):
        resolve_model("test-org/tiny-qwen3-GGUF:Q2_K")


def test_missing_model_or_revision_is_a_clear_error(hub_cache):
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        resolve_model("test-org/not-there")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        resolve_model("test-org/tiny-qwen3", revision="nope")


def test_the_engine_serves_a_hub_id(hub_cache):
    from pagedserve import LLM, SamplingParams
    with LLM("test-org/tiny-qwen3", dtype="float32", num_kv_blocks=64) as llm:
        out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_hub_unreachable_is_one_line_with_the_remedy(tmp_path, monkeypatch, capsys):
    """No network: the HTTP client's own error (httpx's ConnectError is no OSError) becomes one line saying
    what to do, and the CLI prints it and exits 2, without a traceback."""
    from pagedserve.entrypoints.cli import main
    from pagedserve.model import hub

    class ConnectError(Exception):          # as httpx's: not an OSError
        pass

    def unreachable(repo, revision):
        raise ConnectError("[Errno -2] Name or service not known")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_remote_files", unreachable)
    with pytest.raises(ModelLoadError, match=r"could not be fetched from the Hub \(ConnectError: .*HF_HUB_OFFLINE=1"):
        resolve_model("some-org/some-model")
    assert main(["generate", "some-org/some-model", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
