"""A GGUF's byte-level BPE tokenizer built without transformers (pagedserve/gguf_tokenizer.py, issue 56's cold
start) equals transformers' conversion of the same file: the same tokenizer.json (vocabulary, merges, added
tokens and their flags, pre-tokenizer, post-processor, decoder), the same saved config and chat template, and
read back by LightTokenizer the same ids, text, tokens, special tokens and chat renderings as transformers'
tokenizer itself. On the default model (SmolLM2: "smollm" pre, GPT-2's split) and on two files written here
with gguf's GGUFWriter: a Qwen2-style vocabulary (qwen2 pre, user-defined <tool_call>, no unk) and a
Llama-3-style one (llama-bpe pre, add_bos_token, no <|endoftext|> in the vocabulary, a mislabelled control
token)."""
from __future__ import annotations

import json
import os

import pytest

from pagedserve import gguf_tokenizer
from pagedserve.light_tokenizer import LightTokenizer
from pagedserve.tokenizer import apply_chat_template, convert_gguf_tokenizer

TEXTS = ["What is the capital of France?", "", " ", "  ", "\n", "  leading and trailing  ", "a  b   c    d",
         "tabs\tand\nnew\n\nlines\r\n\r\n", "\t\t\tx", "héllo wörld — ünïcödé «quotes» 東京 Ελληνικά русский",
         "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷", "zero\u200bwidth and \u00a0nbsp", "1234567890 3.14159 -42 1,000,000 0x1F",
         "def f(x):\n    return x ** 2  # code\n", "if (a && b) { c[i] = d->e; }", "<div class=\"x\">&amp;</div>",
         "don't won't it's I'M WE'LL they'D", "a" * 300, "The the THE tHe", "ÀÉÎÕÜ ﬁ ﬀ", "e\u0301 vs é",
         "<|im_start|>user\nHi!<|im_end|>", "<|endoftext|> after", "<|begin_of_text|><|eot_id|>x",
         "<tool_call>{\"a\": 1}</tool_call>", "<|im_start|><|im_start|>", "<|im_start|>|>", "<|bad token|>"]
CHATS = [[{"role": "user", "content": "hello"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 😀"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{{ m.content | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "What is the capital of France? Paris is.",
          "def f(x):\n    return x ** 2\n", "1234567890 3.14159 2024", "héllo wörld 東京 😀", "don't won't it's",
          "  spaces   and\ttabs\n\nnewlines  "]


def _bpe(vocab_size: int) -> tuple[list[str], list[str]]:
    """A small byte-level BPE trained on CORPUS: (tokens by id, merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]


def write_bpe_gguf(path, arch: str, pre: str, specials: list[tuple[str, int]], ids: dict, add_bos: bool | None,
                   template: str) -> str:
    """A GGUF with no tensors: a model's shape, and a byte-level BPE vocabulary with `specials` (token, llama.cpp
    token type) after the trained tokens; `ids`: bos/eos/unk/pad -> index into the whole list."""
    import gguf
    tokens, merges = _bpe(400)
    tokens = tokens + [t for t, _ in specials]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(specials)) + [kind for _, kind in specials])
    w.add_token_merges(merges)
    for name, i in ids.items():
        getattr(w, f"add_{name}_token_id")(i)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory, default_source):
    root = tmp_path_factory.mktemp("gguf_tokenizers")
    n = len(_bpe(400)[0])
    qwen = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4), ("</tool_call>", 4),
            ("[PAD1]", 5)]
    llama = [("<|begin_of_text|>", 3), ("<|end_of_text|>", 3), ("<|start_header_id|>", 3), ("<|end_header_id|>", 3),
             ("<|eot_id|>", 3), ("<|bad token|>", 3), ("<think>", 4)]
    return {
        "default": default_source.path,
        "qwen2": write_bpe_gguf(root / "qwen2.gguf", "qwen2", "qwen2", qwen,
                                {"bos": n, "eos": n + 2, "pad": n}, False, CHATML),
        "llama-bpe": write_bpe_gguf(root / "llama.gguf", "llama", "llama-bpe", llama,
                                    {"bos": n, "eos": n + 4}, True, LLAMA3),
    }


@pytest.fixture(scope="module", params=["default", "qwen2", "llama-bpe"])
def built(request, files, tmp_path_factory, converted_default):
    """(the file's metadata, our saved folder, transformers' tokenizer, transformers' saved folder)."""
    path = files[request.param]
    meta = gguf_tokenizer.read_tokenizer_metadata(path)
    assert gguf_tokenizer.refusal(meta) is None
    ours = tmp_path_factory.mktemp("ours")
    gguf_tokenizer.save_tokenizer(meta, str(ours))
    hf = converted_default if request.param == "default" else convert_gguf_tokenizer(path)
    theirs = tmp_path_factory.mktemp("theirs")
    hf.save_pretrained(theirs)
    return meta, str(ours), hf, str(theirs)


def test_the_files_equal_transformers_saved_ones(built):
    _, ours, hf, theirs = built
    with open(os.path.join(ours, "tokenizer.json"), encoding="utf-8") as f:
        assert json.load(f) == json.loads(hf.backend_tokenizer.to_str())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(ours, name), encoding="utf-8") as a, open(os.path.join(theirs, name), encoding="utf-8") as b:
            assert json.load(a) == json.load(b), name
    with open(os.path.join(ours, "chat_template.jinja"), encoding="utf-8") as a, \
            open(os.path.join(theirs, "chat_template.jinja"), encoding="utf-8") as b:
        assert a.read() == b.read()


def test_ids_text_and_special_tokens_equal_transformers(built):
    _, ours, hf, _ = built
    light = LightTokenizer(ours)
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
        ids = hf.encode(text) + [i for i in hf.all_special_ids if i is not None]
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert light(TEXTS).input_ids == hf(TEXTS).input_ids
    assert len(light) == len(hf) and light.get_vocab() == hf.get_vocab() and light.vocab_size == hf.vocab_size
    assert light.added_tokens_encoder == hf.added_tokens_encoder
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(light, name) == getattr(hf, name), name
        assert getattr(light, name + "_id") == getattr(hf, name + "_id"), name
    assert sorted(light.all_special_ids) == sorted(hf.all_special_ids)
    assert light.special_tokens_map == hf.special_tokens_map


def test_chat_template_renders_as_transformers_renders_it(built):
    _, ours, hf, _ = built
    light = LightTokenizer(ours)
    assert light.chat_template == hf.chat_template
    for messages in CHATS:
        for gen in (True, False):
            assert light.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert apply_chat_template(light, messages, add_generation_prompt=gen) == \
                apply_chat_template(hf, messages, add_generation_prompt=gen)


def test_the_files_say_what_the_tests_cover(built):
    """Guards the fixtures: each file exercises what the module docstring says it does."""
    meta, ours, _, _ = built
    light = LightTokenizer(ours)
    pre = meta["tokenizer.ggml.pre"]
    if pre == "llama-bpe":
        assert light.encode("x")[0] == light.bos_token_id                     # add_bos_token
        assert "<|bad token|>" not in light.added_tokens_encoder              # mislabelled control: not added
        assert light.added_tokens_encoder["<|endoftext|>"] == len(meta["tokenizer.ggml.tokens"])   # GPT2's own
    if pre == "qwen2":
        assert light.unk_token is None and light.encode("<tool_call>") == [light.convert_tokens_to_ids("<tool_call>")]


def test_other_tokenizers_are_refused_with_the_reason():
    assert "tokenizer.ggml.model 'llama'" in gguf_tokenizer.refusal(
        {"tokenizer.ggml.model": "llama", "general.architecture": "llama"})
    assert "architecture 'gemma3'" in gguf_tokenizer.refusal(
        {"tokenizer.ggml.model": "gpt2", "general.architecture": "gemma3", "tokenizer.ggml.tokens": ["a"]})
