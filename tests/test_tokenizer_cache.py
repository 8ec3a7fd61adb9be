"""The GGUF tokenizer converted once (issue 56): transformers' conversion of the default model's vocabulary
is saved to the cache as tokenizer.json, and the next load (LightTokenizer: tokenizers alone, no conversion) gives
the same ids, chat template, special tokens and text as the converted tokenizer itself; a damaged saved
tokenizer is converted again; a cache that cannot be written is a warning."""
from __future__ import annotations

import logging
import os

import pytest

from pagedserve import tokenizer as tok_mod
from pagedserve.model.loader import cache_dir
from pagedserve.model.families import from_transformers
from pagedserve.tokenizer import apply_chat_template, build_tokenizer

TEXTS = ["What is the capital of France?", "", " ", "  leading and trailing  ", "tabs\tand\nnew\n\nlines\r\n",
         "héllo wörld — ünïcödé «quotes» 東京 😀👍🏽", "<|im_start|>user\nHi!<|im_end|>", "<|endoftext|> after",
         "def f(x):\n    return x ** 2  # code", "1234567890 3.14159 -42", "a" * 300, "don't won't it's"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 😀"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def converted(default_source):
    """transformers' conversion of the default GGUF, as a fresh process meets it (~10 s)."""
    return tok_mod.convert_gguf_tokenizer(default_source.path)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch, converted):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert(path):                  # the module's conversion, counted (and not paid twice)
        calls.append(path)
        return converted
    monkeypatch.setattr(tok_mod, "convert_gguf_tokenizer", convert)
    return calls


def _saved(default_source) -> str:
    return os.path.join(cache_dir(default_source.path, "tokenizers", extra=from_transformers("__version__")),
                        "tokenizer.json")


def test_the_saved_tokenizer_gives_the_converted_ones_ids(default_source, converted, empty_cache):
    first = build_tokenizer(default_source)
    assert empty_cache == [default_source.path] and os.path.isfile(_saved(default_source))
    saved = build_tokenizer(default_source)
    assert len(empty_cache) == 1, "the second load converted again"
    assert type(saved).__name__ == "LightTokenizer" and type(first).__name__ == "LightTokenizer"
    for text in TEXTS:
        for special in (True, False):
            assert saved(text, add_special_tokens=special).input_ids == \
                converted(text, add_special_tokens=special).input_ids, text
        ids = converted(text).input_ids
        assert saved.decode(ids) == converted.decode(ids)
        assert saved.decode(ids, skip_special_tokens=True) == converted.decode(ids, skip_special_tokens=True)
    assert apply_chat_template(saved, MESSAGES) == apply_chat_template(converted, MESSAGES)
    assert apply_chat_template(saved, MESSAGES, add_generation_prompt=False) == \
        apply_chat_template(converted, MESSAGES, add_generation_prompt=False)
    assert saved.chat_template == converted.chat_template
    assert len(saved) == len(converted) and saved.get_vocab() == converted.get_vocab()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(saved, attr) == getattr(converted, attr), attr


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_saved_tokenizer_is_converted_again(default_source, converted, empty_cache, caplog, damage):
    build_tokenizer(default_source)
    path = _saved(default_source)
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:
        with open(path, "wb") as f:
            f.write(os.urandom(2048))
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        tok = build_tokenizer(default_source)
    assert "ignored" in caplog.text and len(empty_cache) == 2
    assert tok("Paris").input_ids == converted("Paris").input_ids
    build_tokenizer(default_source)               # saved whole again: loaded, not converted
    assert len(empty_cache) == 2


def test_an_unwritable_cache_is_a_warning(default_source, converted, empty_cache, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(blocker / "cache"))     # (as root a read-only mode would not stop it)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        tok = build_tokenizer(default_source)
    assert "not saved" in caplog.text
    assert tok("Paris").input_ids == converted("Paris").input_ids
