"""Tokenizer glue: load the model's own tokenizer and chat template (from the GGUF metadata or
the HF folder), and detokenize incrementally so streamed text is right across multi-byte UTF-8
characters split over several tokens."""
from __future__ import annotations

import os
import threading

from pagedserve.errors import ParamError
from pagedserve.model.loader import ModelLoadError, ModelSource, cache_dir


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


_LOADED: dict[tuple, SerialTokenizer] = {}
_LOADED_LOCK = threading.Lock()


def load_tokenizer(src: ModelSource) -> SerialTokenizer:
    """A transformers tokenizer behind one lock (SerialTokenizer). A GGUF's vocabulary is converted
    once (slow: ~10 s for 49k tokens) and the result cached on disk, keyed by the file's path, size
    and mtime; within a process a GGUF's tokenizer is built once and shared by every engine on that
    file (as its weights are: model/loader.py), since nothing writes to a tokenizer after it is built
    (reading it from tokenizer.json costs ~1-1.5 s per engine otherwise)."""
    if src.kind == "hf":
        return _build_tokenizer(src)
    st = os.stat(src.path)
    key = (os.path.realpath(src.path), st.st_size, st.st_mtime_ns)
    with _LOADED_LOCK:      # two engines started at once build it once
        if key not in _LOADED:
            _LOADED[key] = _build_tokenizer(src)
        return _LOADED[key]


def _build_tokenizer(src: ModelSource) -> SerialTokenizer:
    from pagedserve.model.families import from_transformers
    AutoTokenizer = from_transformers("AutoTokenizer")
    try:
        if src.kind == "hf":
            return SerialTokenizer(AutoTokenizer.from_pretrained(src.path))
        cache = cache_dir(src.path, "tokenizers")
        if os.path.isfile(os.path.join(cache, "tokenizer.json")):
            return SerialTokenizer(AutoTokenizer.from_pretrained(cache))
        tok = AutoTokenizer.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path))
        try:
            tok.save_pretrained(cache)
        except OSError:
            pass  # a read-only home only costs the conversion next time
        return SerialTokenizer(tok)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer for {src.path}: {e}") from e


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
