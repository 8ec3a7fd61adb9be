"""The light tokenizer (tokenizers + jinja2, no transformers: issue 56) gives transformers' results on the
same files: ids with and without special tokens, text with and without them, tokens, the vocabulary,
the special tokens, and chat templates rendered and tokenized alike (the model's own and others: tools,
documents, system messages, add_generation_prompt, continue_final_message, reasoning, namespaces, loop
controls, raise_exception). On the default model's saved tokenizer and on the tiny HF folders the suite
writes; and `pagedserve generate` on the default path runs with transformers unimportable."""
from __future__ import annotations

import os
import subprocess
import sys

import jinja2
import pytest

from pagedserve.light_tokenizer import LightTokenizer, light_refusal
from pagedserve.tokenizer import IncrementalDetokenizer, apply_chat_template, build_tokenizer

TEXTS = ["What is the capital of France?", "", " ", "  leading and trailing  ", "tabs\tand\nnew\n\nlines\r\n",
         "héllo wörld — ünïcödé «quotes» 東京 😀👍🏽", "<|im_start|>user\nHi!<|im_end|>", "<|endoftext|> after",
         "w3 w4 w17 w9 <s> w5 </s>", "w100\nw101 <image> <fake_token_around_image>", "def f(x):\n    return x ** 2",
         "don't won't it's . , ?", "a" * 300]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS = {
    "user": [{"role": "user", "content": "hello"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 😀"},
               {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}],
    "tool calls": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "content": "18 C", "tool_call_id": "c1"}],
    "reasoning": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "two and two"}],
}
TOOLS_TEMPLATE = (   # tests/entrypoints/test_clients.py's: a template that renders tools
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nCall one as <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% if documents %}{% for d in documents %}<doc {{ loop.index }}>{{ d.title }}: {{ d.text }}</doc>
{% endfor %}{% endif %}
{% if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% for m in messages %}
    {% if m.role not in ("system", "user", "assistant", "tool") %}{{ raise_exception("bad role " + m.role) }}{% endif %}
    {% if m.role == "tool" and skip_tools %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    <|im_start|>{{ m.role }}
    {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}
    {% if m.role == "assistant" %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
    {% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}
    {% if m.content is none %}NONE{% endif %}
<|im_end|>
{% endfor %}
{{ dict(a=1, b="é") | tojson }} {{ ns.n }} {{ strftime_now("%Y") }} {{ eos_token }}{{ pad_token }}
{% if enable_thinking is defined %}thinking={{ enable_thinking }}{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _hf(folder: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """name -> a tokenizer folder: the default model's saved one and the suite's tiny HF ones."""
    from tests.model.families import CHAT_TEMPLATE, tiny_tokenizer
    from tests.model.test_encoders import _tokenizer
    from tokenizers import AddedToken
    assert isinstance(tokenizer, LightTokenizer)
    out = {"default": tokenizer.folder}
    root = tmp_path_factory.mktemp("tokenizers")
    word = tiny_tokenizer(256)
    word.save_pretrained(root / "word")
    word.add_tokens([AddedToken("\n", normalized=False)])         # as tests/model/families.py's Idefics3 one
    word.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>"]})
    word.chat_template = CHAT_TEMPLATE
    word.save_pretrained(root / "idefics3")
    bert, _ = _tokenizer("[CLS]", "[SEP]", "[PAD]")
    bert.save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "resaved")                     # tests/model/helpers.py's save_random_llama
    out |= {name: str(root / name) for name in ("word", "idefics3", "bert", "resaved")}
    return out


@pytest.fixture(scope="module", params=["default", "word", "idefics3", "bert", "resaved"])
def pair(request, folders):
    folder = folders[request.param]
    assert light_refusal(folder) is None, light_refusal(folder)
    return LightTokenizer(folder), _hf(folder)


def test_ids_text_tokens_and_vocabulary_equal_transformers(pair):
    light, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert light(text, add_special_tokens=special).input_ids == hf(text, add_special_tokens=special).input_ids
            assert light.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids = hf(text).input_ids + [i for i in hf.all_special_ids if i is not None]
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert light.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
    assert light(TEXTS).input_ids == hf(TEXTS).input_ids                 # a batch
    assert len(light) == len(hf) and light.get_vocab() == hf.get_vocab() and light.vocab_size == hf.vocab_size
    assert light.added_tokens_encoder == hf.added_tokens_encoder
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        assert getattr(light, name) == getattr(hf, name), name
        assert getattr(light, name + "_id") == getattr(hf, name + "_id"), name
    assert sorted(light.all_special_ids) == sorted(hf.all_special_ids)
    assert light.special_tokens_map == hf.special_tokens_map
    assert light.chat_template == hf.chat_template


def test_streamed_text_equals_transformers_decode(pair):
    light, hf = pair
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (True, False):
            d = IncrementalDetokenizer(light, skip_special_tokens=skip)
            assert "".join(d.add(t) for t in ids) + d.flush() == hf.decode(ids, skip_special_tokens=skip)


def _both(light, hf, messages, **kw):
    """(light, transformers) of one rendering: the text and the ids, or the error each raised."""
    out = []
    for tok in (light, hf):
        try:
            text = tok.apply_chat_template(messages, tokenize=False, **kw)
            out.append((text, apply_chat_template(tok, messages, **kw)))
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            out.append((type(e).__name__, str(e)))
    return out


@pytest.mark.parametrize("template", ["own", "tools", "rich"])
def test_chat_templates_render_as_transformers_renders_them(pair, template):
    light, hf = pair
    chat_template = {"own": None, "tools": TOOLS_TEMPLATE, "rich": RICH_TEMPLATE}[template]
    if chat_template is None and hf.chat_template is None:
        pytest.skip("this tokenizer has no template of its own")
    for name, messages in CONVERSATIONS.items():
        for gen in (True, False):
            for tools in (None, TOOLS):
                kw = dict(add_generation_prompt=gen, tools=tools, chat_template=chat_template)
                got, want = _both(light, hf, messages, **kw)
                assert got == want, (name, kw)
    extra = dict(chat_template=chat_template, add_generation_prompt=False)
    cases = [dict(documents=[{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]),
             dict(enable_thinking=False, skip_tools=True), dict(continue_final_message=True)]
    for kw in cases:
        for messages in CONVERSATIONS.values():
            got, want = _both(light, hf, messages, **extra, **kw)
            assert got == want, kw


def test_template_errors_are_transformers_errors(pair):
    light, hf = pair
    bad = [{"role": "wizard", "content": "x"}]
    got, want = _both(light, hf, bad, chat_template=RICH_TEMPLATE)
    assert got == want and got[0] == "TemplateError" and "bad role wizard" in got[1]
    escape = "{{ messages.__class__.__mro__ }}"
    assert _both(light, hf, bad, chat_template=escape)[0][0] == _both(light, hf, bad, chat_template=escape)[1][0]


def test_folders_transformers_would_change_load_through_it(tmp_path, tokenizer):
    import json
    tokenizer.save_pretrained(tmp_path)
    assert light_refusal(str(tmp_path)) is None
    with open(tmp_path / "tokenizer_config.json") as f:
        cfg = json.load(f)
    for key, value in (("add_bos_token", True), ("tokenizer_class", "LlamaTokenizer"),
                       ("clean_up_tokenization_spaces", True)):
        with open(tmp_path / "tokenizer_config.json", "w") as f:
            json.dump(cfg | {key: value}, f)
        assert key in light_refusal(str(tmp_path))
    os.remove(tmp_path / "tokenizer.json")
    assert light_refusal(str(tmp_path)) == "no tokenizer.json"


def test_a_tokenizer_json_with_truncation_loads_through_transformers(tmp_path, tokenizer):
    """Truncation in tokenizer.json (which transformers applies) makes the light reader step aside for
    transformers, as the refusals above do, rather than fail the load."""
    import json
    from pagedserve.model.loader import ModelSource
    from pagedserve.tokenizer import SerialTokenizer
    tokenizer.save_pretrained(tmp_path)
    with open(tmp_path / "tokenizer.json") as f:
        spec = json.load(f)
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    with open(tmp_path / "tokenizer.json", "w") as f:
        json.dump(spec, f)
    tok = build_tokenizer(ModelSource("hf", str(tmp_path), "truncating"))
    assert isinstance(tok, SerialTokenizer)
    assert tok(TEXTS[0])["input_ids"] == _hf(str(tmp_path))(TEXTS[0])["input_ids"]


def test_hf_folders_get_the_light_tokenizer_where_it_reads_them(folders):
    from pagedserve.model.loader import ModelSource
    from pagedserve.tokenizer import SerialTokenizer
    assert isinstance(build_tokenizer(ModelSource("hf", folders["word"], "word")), LightTokenizer)
    bert_folder = folders["bert"]
    assert isinstance(build_tokenizer(ModelSource("hf", bert_folder, "bert")),
                      LightTokenizer if light_refusal(bert_folder) is None else SerialTokenizer)


def test_grammar_tokenizer_equals_llguidance_hf(tokenizer):
    """The grammar's llguidance tokenizer is built from the light tokenizer's Rust object as llguidance.hf
    builds it from transformers': the same JSON."""
    import json
    from copy import copy
    hf = tokenizer.transformers()
    assert tokenizer.transformers() is hf                # built once, kept by its owner
    backend = copy(hf.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    assert json.loads(tokenizer.backend_tokenizer.to_str()) == json.loads(backend.to_str())


PROBE = """
import sys
sys.modules["transformers"] = None          # importing it now fails
from pagedserve.entrypoints.cli import main
code = main(sys.argv[1:])
print("transformers imported:", sys.modules.get("transformers") is not None)
sys.exit(code)
"""


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_generate_on_the_default_path_does_not_import_transformers(tokenizer, tmp_path, cache):
    """`tokenizer` first: the default model's converted tokenizer is in the cache, as after a first start.
    cold: an empty cache folder but for the native builds (the start gcc's, no transformers in them): the
    GGUF's tokenizer is converted without transformers, the weights read and packed again."""
    from pagedserve.host import cache_root
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if cache == "cold":
        os.makedirs(os.path.join(cache_root(), "kernels"), exist_ok=True)
        os.symlink(os.path.join(cache_root(), "kernels"), tmp_path / "kernels")
        env["PAGEDSERVE_CACHE"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", PROBE, "generate", "What is the capital of France?", "--max-tokens", "4"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "transformers imported: False" in r.stdout and r.stdout.strip().splitlines()[0]
    if cache == "cold":
        assert os.listdir(tmp_path / "tokenizers"), "no tokenizer was converted"
