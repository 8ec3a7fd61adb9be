"""Tokenizer glue: load the model's own tokenizer and chat template (from the GGUF metadata or
the HF folder), and detokenize incrementally so streamed text is right across multi-byte UTF-8
characters split over several tokens."""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading

from pagedserve import gguf_tokenizer
from pagedserve.errors import ParamError
from pagedserve.light_tokenizer import LightTokenizer, light_refusal
from pagedserve.model.source import ModelLoadError, ModelSource, cache_dir

log = logging.getLogger("pagedserve")


class SerialTokenizer:
    """One owner of a transformers tokenizer that many threads call (the server's worker threads
    template and tokenize, the event loop and the engine thread detokenize): its calls take one lock,
    one at a time. A fast tokenizer is a Rust object whose encode path sets truncation and padding on
    it, and concurrent calls raise "Already borrowed" (one request's failure caused by another's).
    Everything else (vocabulary, special tokens, the chat template) is read through as it is;
    `inner` is the tokenizer itself, for libraries that take one (llguidance)."""

    CALLS = ("__call__", "encode", "decode", "batch_decode", "apply_chat_template", "tokenize",
             "convert_ids_to_tokens", "convert_tokens_to_ids", "convert_tokens_to_string")

    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "_lock", threading.RLock())

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.CALLS:
            return attr
        lock = self._lock

        def serial(*args, **kwargs):
            with lock:
                return attr(*args, **kwargs)
        return serial

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self.inner(*args, **kwargs)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def __len__(self) -> int:
        return len(self.inner)


_LOADED: dict[tuple, LightTokenizer | SerialTokenizer] = {}
_LOADED_LOCK = threading.Lock()


def load_tokenizer(src: ModelSource, compile_template: bool = False):
    """The model's tokenizer (`build_tokenizer`). Within a process a GGUF's tokenizer is built once and
    shared by every engine on that file (as its weights are: model/loader.py), since nothing writes to a
    tokenizer after it is built (reading the saved tokenizer.json costs ~0.3-1.5 s per engine otherwise).
    `compile_template`: the chat template compiled now (jinja2's import and the compile, ~0.15 s: the
    engine loads the tokenizer beside the model, so the first chat does not pay them)."""
    if src.kind == "hf":
        tok = build_tokenizer(src)
    else:
        st = os.stat(src.path)
        key = (os.path.realpath(src.path), st.st_size, st.st_mtime_ns)
        with _LOADED_LOCK:      # two engines started at once build it once
            if key not in _LOADED:
                _LOADED[key] = build_tokenizer(src)
            tok = _LOADED[key]
    if compile_template and isinstance(tok, LightTokenizer):
        tok.compile_chat_template()
    return tok


def build_tokenizer(src: ModelSource):
    """The model's tokenizer: a LightTokenizer (tokenizers alone, no transformers import) where its files
    allow, else transformers' behind one lock (SerialTokenizer). A GGUF's vocabulary is converted once and
    saved to the cache as tokenizer.json (+ its config and chat template), keyed by the file's path, size
    and mtime and by who converted it: a byte-level BPE one by gguf_tokenizer.py (transformers' conversion
    repeated with tokenizers alone: ~0.5 s for 49k tokens, where transformers takes ~10 s and its import),
    any other by transformers (its version in the key). Later starts read the saved one with tokenizers
    (~0.3 s). A saved tokenizer that does not load is converted again; a cache that cannot be written only
    costs the conversion next time."""
    try:
        if src.kind == "hf":
            return _folder_tokenizer(src.path)
        light_cache = cache_dir(src.path, "tokenizers", extra=gguf_tokenizer.FORMAT)
        hf_cache = cache_dir(src.path, "tokenizers", extra=transformers_version())
        for cache in (light_cache, hf_cache):
            tok = _read_saved(cache, src.path)
            if tok is not None:
                return tok
        meta = gguf_tokenizer.read_tokenizer_metadata(src.path)
        why = gguf_tokenizer.refusal(meta, os.path.dirname(src.path))
        if why is None:
            return _light_gguf_tokenizer(meta, light_cache, src.path)
        log.info("GGUF tokenizer converted by transformers (%s)", why)
        tok = convert_gguf_tokenizer(src.path)
        if _save(tok.save_pretrained, hf_cache):
            try:
                return LightTokenizer(hf_cache)
            except Exception as e:          # noqa: BLE001 -- the converted one serves this start
                log.warning("saved tokenizer in %s does not load (%s); using the converted one", hf_cache, e)
        return SerialTokenizer(tok)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer for {src.path}: {e}") from e


def _read_saved(cache: str, path: str) -> LightTokenizer | None:
    """The tokenizer saved in `cache`; None when there is none or it does not load (then converted again)."""
    if not os.path.isfile(os.path.join(cache, "tokenizer.json")):
        return None
    try:
        return LightTokenizer(cache)
    except Exception as e:     # truncated, garbled: converted again
        log.warning("saved tokenizer in %s ignored (%s: %s); converting %s's vocabulary again", cache,
                    type(e).__name__, str(e)[:200], os.path.basename(path))
        return None


def _light_gguf_tokenizer(meta: dict, cache: str, path: str) -> LightTokenizer:
    """Built by gguf_tokenizer.py into the cache; into a folder of this process's where the cache cannot
    be written (removed at exit)."""
    if _save(lambda folder: gguf_tokenizer.save_tokenizer(meta, folder), cache):
        return LightTokenizer(cache)
    folder = tempfile.mkdtemp(prefix="pagedserve-tokenizer-")
    atexit.register(shutil.rmtree, folder, True)
    gguf_tokenizer.save_tokenizer(meta, folder)
    log.info("tokenizer of %s built in %s", os.path.basename(path), folder)
    return LightTokenizer(folder)


def _folder_tokenizer(path: str):
    """An HF folder's: light where tokenizers alone reads it as transformers does (light_refusal)."""
    why = light_refusal(path)
    if why is None:
        try:
            return LightTokenizer(path)
        except ValueError as e:             # truncation or padding in tokenizer.json: transformers applies them
            why = str(e)
    from pagedserve.model.families import from_transformers
    log.info("tokenizer through transformers (%s)", why)
    return SerialTokenizer(from_transformers("AutoTokenizer").from_pretrained(path))


def transformers_version() -> str:
    """Part of the saved tokenizer's key (the conversion is transformers'), read without importing it."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "none"


def convert_gguf_tokenizer(path: str):
    """transformers' own conversion of a GGUF file's vocabulary to a fast tokenizer (for the files
    gguf_tokenizer.refusal names; the tests' reference for the others)."""
    from pagedserve.model.families import from_transformers
    return from_transformers("AutoTokenizer").from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _save(save, cache: str) -> bool:
    """`save(folder)` into a folder of its own first, then renamed into place: a reader sees a whole
    tokenizer or none. Whether it was saved."""
    tmp = f"{cache}.{os.getpid()}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save(tmp)
        shutil.rmtree(cache, ignore_errors=True)      # a damaged one
        os.replace(tmp, cache)
        return True
    except OSError as e:
        log.warning("converted tokenizer not saved (%s: %s): the next start converts it again", cache,
                    e.strerror or e)
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, chat_template: str | None = None,
                        continue_final_message: bool = False, **template_kwargs) -> list[int]:
    """Token ids of the conversation. `chat_template` replaces the model's own (a server's
    --chat-template); `tools` and `template_kwargs` reach the template as variables."""
    if not (chat_template or tokenizer.chat_template):
        raise ParamError("messages", "messages: this model has no chat template; use a plain prompt instead")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ParamError("messages", f"messages[{i}]: each message needs 'role' and 'content'")
    if continue_final_message:
        if add_generation_prompt:
            raise ParamError("continue_final_message", "continue_final_message: not with add_generation_prompt")
        if messages[-1]["role"] != "assistant":
            raise ParamError("continue_final_message",
                             "continue_final_message: the last message must be the assistant's")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        tools=tools, chat_template=chat_template,
                                        continue_final_message=continue_final_message, **template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):   # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window [prefix_offset:] and compares it with the window without the newest
    tokens; text ending in U+FFFD is an incomplete UTF-8 character, so it waits for more tokens.
    """

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "skip_special")

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:]) if prompt_ids else []   # context for leading spaces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip_special = skip_special_tokens

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes to U+FFFD, as a
        one-shot decode of the same tokens gives)."""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
