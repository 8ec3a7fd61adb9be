"""Hub ids: `ORG/NAME[:QUANT]` resolved to a local folder or GGUF file through huggingface_hub, as
vLLM and llama.cpp's `-hf ORG/NAME:Q4_K_M` do. Safetensors are preferred when a repository has
both; a GGUF-only repository picks its file by quantization name. HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE and a revision are honoured (read when called, not when huggingface_hub was imported)."""
from __future__ import annotations

import fnmatch
import os
import re

HF_FOLDER_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt")
DEFAULT_GGUF_QUANT = "Q4_K_M"       # llama.cpp's default for -hf without a tag

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")


def looks_like_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "~"))


def hub_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def download(model: str, revision: str | None = None) -> str:
    """A local path (HF folder or .gguf file) for hub id `model`; raises ValueError saying why not."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    repo, _, quant = model.partition(":")
    cache, local = hub_cache_dir(), offline()
    try:
        files = _cached_files(repo, revision, cache) if local else _remote_files(repo, revision)
        patterns = _choose(repo, files, quant)
        folder = snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=patterns,
                                   local_files_only=local)
    except GatedRepoError:
        raise ValueError(f"model {repo!r} is gated or private on the Hub: accept its terms and log in "
                         "(huggingface-cli login or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {repo!r} not found on the Hub (or private: log in with HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"model {repo!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"model {model!r} is not in the Hub cache {cache} and HF_HUB_OFFLINE is set "
                         "(download it first, or unset HF_HUB_OFFLINE)") from None
    except HfHubHTTPError as e:
        raise ValueError(f"model {model!r}: the Hub answered {e}") from None
    except ValueError:
        raise
    except Exception as e:            # no network (the HTTP client's own errors: httpx's are no OSError), a broken cache
        raise ValueError(f"model {model!r} could not be fetched from the Hub ({type(e).__name__}: {e}): check the "
                         "network, or use the Hub cache (HF_HUB_OFFLINE=1, HF_HOME), or give a local .gguf file or "
                         "HF folder") from None
    ggufs = [p for p in patterns if p.endswith(".gguf")]
    return os.path.join(folder, ggufs[0]) if ggufs else folder


def _remote_files(repo: str, revision: str | None) -> list[str]:
    from huggingface_hub import HfApi
    return HfApi().list_repo_files(repo, revision=revision)


def _cached_files(repo: str, revision: str | None, cache: str) -> list[str]:
    """The files of the cached snapshot (HF_HUB_OFFLINE): refs/<revision> -> snapshots/<commit>."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    rev = revision or "main"
    ref = os.path.join(root, "refs", rev)
    commit = rev
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snap = os.path.join(root, "snapshots", commit)
    if not os.path.isdir(snap):
        raise LocalEntryNotFoundError(f"{repo}@{rev} not cached")
    return [os.path.relpath(os.path.join(d, f), snap) for d, _, fs in os.walk(snap) for f in fs]


def _choose(repo: str, files: list[str], quant: str) -> list[str]:
    """What to fetch: the HF folder's files, or the one GGUF whose name carries `quant`."""
    has_st = "config.json" in files and any(f.endswith(".safetensors") for f in files)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if has_st and not quant:
        return [f for f in files if any(fnmatch.fnmatch(os.path.basename(f), p) for p in HF_FOLDER_FILES)]
    if not ggufs:
        what = "no .gguf files" if quant else "neither config.json with *.safetensors nor .gguf files"
        raise ValueError(f"model {repo!r} has {what} (files: {files[:10]})")
    want = quant or (DEFAULT_GGUF_QUANT if len(ggufs) > 1 else "")
    picked = [f for f in ggufs if want.lower() in os.path.basename(f).lower()]
    picked = [f for f in picked if "mmproj" not in f.lower()] or picked
    if len(picked) != 1:
        raise ValueError(f"model {repo!r}: {'no' if not picked else 'several'} .gguf files match quantization "
                         f"{want!r}; choose one with {repo}:QUANT among {[os.path.basename(f) for f in ggufs]}")
    return picked
