"""The GGUF tokenizer converted once (issue 56): the default model's vocabulary, converted by gguf_tokenizer.py
(transformers' conversion repeated with tokenizers alone), is saved to the cache as tokenizer.json, and the next
load (LightTokenizer: tokenizers alone, no conversion) gives the same ids, chat template, special tokens and text
as transformers' converted tokenizer; a damaged saved tokenizer is converted again; a cache that cannot be
written is a warning; a file gguf_tokenizer refuses is converted by transformers and saved under its key."""
from __future__ import annotations

import logging
import os

import pytest

from pagedserve import gguf_tokenizer
from pagedserve import tokenizer as tok_mod
from pagedserve.model.loader import cache_dir
from pagedserve.model.families import from_transformers
from pagedserve.tokenizer import apply_chat_template, build_tokenizer

TEXTS = ["What is the capital of France?", "", " ", "  leading and trailing  ", "tabs\tand\nnew\n\nlines\r\n",
         "héllo wörld — ünïcödé «quotes» 東京 😀👍🏽", "<|im_start|>user\nHi!<|im_end|>", "<|endoftext|> after",
         "def f(x):\n    return x ** 2  # code", "1234567890 3.14159 -42", "a" * 300, "don't won't it's"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 😀"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def converted(converted_default):
    """transformers' conversion of the default GGUF, as a fresh process meets it (~10 s; shared)."""
    return converted_default


@pytest.fixture
def empty_cache(tmp_path, monkeypatch, default_source):
    """Each conversion of the default file, counted: gguf_tokenizer's (its path) and transformers' (none
    expected but where a test asks for it)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    calls = []
    save = gguf_tokenizer.save_tokenizer

    def counted(meta, folder):
        calls.append(default_source.path)
        return save(meta, folder)
    monkeypatch.setattr(gguf_tokenizer, "save_tokenizer", counted)
    monkeypatch.setattr(tok_mod, "convert_gguf_tokenizer", lambda path: pytest.fail("converted by transformers"))
    return calls


def _saved(default_source, extra: str = gguf_tokenizer.FORMAT) -> str:
    return os.path.join(cache_dir(default_source.path, "tokenizers", extra=extra), "tokenizer.json")


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


def test_a_refused_file_is_converted_by_transformers_and_saved_under_its_key(default_source, converted,
                                                                              empty_cache, monkeypatch, caplog):
    calls = []

    def convert(path):
        calls.append(path)
        return converted
    monkeypatch.setattr(gguf_tokenizer, "refusal", lambda meta, folder: "tokenizer.ggml.model 'llama' (for the test)")
    monkeypatch.setattr(tok_mod, "convert_gguf_tokenizer", convert)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        tok = build_tokenizer(default_source)
    assert calls == [default_source.path] and empty_cache == [] and "for the test" in caplog.text
    assert os.path.isfile(_saved(default_source, from_transformers("__version__")))
    assert not os.path.isfile(_saved(default_source))
    assert tok(TEXTS[0]).input_ids == converted(TEXTS[0]).input_ids
    assert type(build_tokenizer(default_source)).__name__ == "LightTokenizer" and len(calls) == 1   # read back
