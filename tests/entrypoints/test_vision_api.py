"""Images over the OpenAI chat API (issue 55), through the openai SDK: `image_url` parts with data URLs
(PNG, JPEG) go through the chat template and give HF transformers' greedy tokens for the same text and
image; every bad image is a 400 naming its part; http(s) URLs are never fetched (a domain outside
--allowed-media-domains is refused naming it, one inside is refused as not implemented); nothing is
left held after the refusals."""
from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from tests.entrypoints.helpers import serve_in_thread
from tests.entrypoints.test_clients import idle
from tests.model.families import random_image, save_tiny_llava, tiny_tokenizer
from tests.model.helpers import save_random_llama


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    d = tmp_path_factory.mktemp("llava")
    hf, proc = save_tiny_llava(d)
    return str(d), hf, proc


@pytest.fixture(scope="module")
def server(llava):
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(llava[0], dtype="float32", num_kv_blocks=128, block_size=4,
                                  limit_mm_per_prompt='{"image": 2}', allowed_media_domains=["images.example.com"]))
    with serve_in_thread(build_app(engine, served_model_name="m")) as base:
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(client, content, n: int = 8, model: str = "m"):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=n, temperature=0)


def _hf_text(llava, text: str, images, n: int = 8) -> tuple[str, int]:
    """HF's greedy continuation of the rendered chat text with its images, as text; its prompt length."""
    _, hf, proc = llava
    inp = proc(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inp, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = out[0, inp["input_ids"].shape[1]:].tolist()
    return proc.tokenizer.decode(ids, skip_special_tokens=True), inp["input_ids"].shape[1]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_image_url_parts_equal_hf(client, server, llava, fmt):
    from PIL import Image
    url = data_url(random_image(1), fmt)
    # HF gets the pixels the file holds (a JPEG's decoded ones)
    img = Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))).convert("RGB")
    r = _chat(client, [{"type": "text", "text": "w6 w7"}, {"type": "image_url", "image_url": {"url": url}}])
    # the chat template (w3 {content} w4 w5) over the image placeholder written before the text
    want, n_prompt = _hf_text(llava, "w3 <image>\nw6 w7 w4 w5", [img])
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 8
    assert idle(server[1])


def test_two_images_and_the_stream(client, server, llava):
    imgs = [random_image(2), random_image(3)]
    content = [{"type": "image_url", "image_url": {"url": data_url(imgs[0])}}, {"type": "text", "text": "w9"},
               {"type": "image_url", "image_url": {"url": data_url(imgs[1])}}]
    want, _ = _hf_text(llava, "w3 <image>\n<image>\nw9 w4 w5", imgs)
    assert _chat(client, content).choices[0].message.content == want
    chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=8,
                                            temperature=0, stream=True)
    # (the word-level tokenizer's incremental detokenization opens with the space between words)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == want
    assert idle(server[1])


def _png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _b64(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _tiff() -> str:
    buf = io.BytesIO()
    random_image(1).save(buf, format="TIFF")
    return _b64(buf.getvalue(), "image/tiff")


def _huge() -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("L", (5000, 4000)).save(buf, format="PNG")     # 20 M pixels, a few KiB of PNG
    return _b64(buf.getvalue())


URL = "messages[0].content[0].image_url.url"
BAD = {
    "bad-base64": (lambda: "data:image/png;base64,@@@not base64@@@", URL, "base64"),
    "not-an-image": (lambda: _b64(b"hello, I am text"), URL, "not an image"),
    "truncated": (lambda: _b64(_png_bytes(random_image(1))[:300]), URL, "truncated or corrupt"),
    "tiff": (_tiff, URL, "TIFF is not supported"),
    "too-many-pixels": (_huge, URL, "pixels"),
    "not-a-data-url": (lambda: "data:text/plain,hello", URL, "data URL"),
    "file-scheme": (lambda: "file:///etc/passwd", URL, "scheme"),
    "domain-not-allowed": (lambda: "http://169.254.169.254/latest/meta-data", URL, "allowed-media-domains"),
    "allowed-but-not-fetched": (lambda: "https://images.example.com/cat.png", URL, "not implemented"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_is_a_400_naming_the_part(client, server, case):
    url, param, words = BAD[case]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [{"type": "image_url", "image_url": {"url": url()}}, {"type": "text", "text": "w6"}])
    err = e.value.body
    assert err["param"] == param and words in err["message"], err
    assert idle(server[1]) and not any(server[1].held().values())


def test_more_images_than_the_limit(client, server):
    part = {"type": "image_url", "image_url": {"url": data_url(random_image(1))}}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [part, part, part])
    assert e.value.body["param"] == "messages" and "limit-mm-per-prompt" in e.value.body["message"]
    # a placeholder typed in the text is one more image than the parts give
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, [part, {"type": "text", "text": "<image> w6"}])
    assert e.value.body["param"] == "messages"
    assert idle(server[1]) and not any(server[1].held().values())
    assert _chat(client, [part, {"type": "text", "text": "w6"}]).usage.completion_tokens == 8   # still serving


def test_metrics_count_encoder_cache_hits(client, server):
    import httpx

    def value(text: str, name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
    part = {"type": "image_url", "image_url": {"url": data_url(random_image(7))}}
    before = httpx.get(server[0] + "/metrics").text
    for _ in range(2):
        _chat(client, [part, {"type": "text", "text": "w6"}])
    after = httpx.get(server[0] + "/metrics").text
    runs, hits = "pagedserve:encoder_cache_misses_total", "pagedserve:encoder_cache_hits_total"
    assert value(after, runs) - value(before, runs) == 1 and value(after, hits) - value(before, hits) == 1
    assert value(after, "pagedserve:encoder_cache_tokens") >= 16


def test_an_image_to_a_text_only_model(tmp_path):
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    tok = tiny_tokenizer(256)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    engine = LLMEngine(EngineArgs(save_random_llama(tmp_path / "llama", tok), dtype="float32", num_kv_blocks=32))
    with serve_in_thread(build_app(engine, served_model_name="m")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, [{"type": "text", "text": "w6"},
                           {"type": "image_url", "image_url": {"url": data_url(random_image(1))}}])
        assert e.value.body["param"] == "messages[0].content[1].image_url"
        assert "takes no images" in e.value.body["message"]


def test_anthropic_image_blocks_equal_chat(client, server):
    """/v1/messages through the anthropic SDK: a base64 image block is the chat's image_url part (the
    same prompt, the same tokens); count_tokens counts its image tokens; a URL source is never fetched."""
    import anthropic
    ac = anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0)
    url = data_url(random_image(4))
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.partition(",")[2]}}
    content = [image, {"type": "text", "text": "w6 w7"}]
    m = ac.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0.0},
                           messages=[{"role": "user", "content": content}])
    chat = _chat(client, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w6 w7"}])
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    assert ac.messages.count_tokens(model="m", messages=[{"role": "user", "content": content}]).input_tokens == \
        chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/x.png"}}]}])
    assert "allowed-media-domains" in e.value.body["error"]["message"]
    assert idle(server[1]) and not any(server[1].held().values())


def test_idefics3_over_http_equals_hf(tmp_path):
    """Idefics3 (model/idefics3.py) behind the same API: two images in one chat message, each split into
    crops as HF's processor splits it, give HF's greedy text and its prompt length; the same images again
    hit the encoder cache, crop by crop."""
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    from tests.model.families import save_tiny_idefics3
    model = (str(tmp_path), *save_tiny_idefics3(tmp_path))
    imgs = [random_image(1), random_image(2, (80, 40))]          # 2x2 crops + global, 1x2 + global
    content = [{"type": "image_url", "image_url": {"url": data_url(imgs[0])}}, {"type": "text", "text": "w9"},
               {"type": "image_url", "image_url": {"url": data_url(imgs[1])}}]
    want, n_prompt = _hf_text(model, "w3 <image>\n<image>\nw9 w4 w5", imgs)
    engine = LLMEngine(EngineArgs(model[0], dtype="float32", num_kv_blocks=160, block_size=4))
    with serve_in_thread(build_app(engine, served_model_name="m")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        for _ in range(2):
            r = _chat(client, content)
            assert r.choices[0].message.content == want and r.usage.prompt_tokens == n_prompt
        enc = engine.core.scheduler.encoder
        assert engine.core.runner.encoder_runs == 8 and enc.misses == 8
        assert idle(engine)


def test_gemma3_over_http_equals_hf(tmp_path):
    """Gemma 3 (model/gemma3_vision.py) behind the same API: two images in one chat message become
    `<start_of_image>` each, written out as HF's processor writes them ("\\n\\n" around, the newline after the
    placeholder joining the run), and give HF's greedy text and prompt length, the image's tokens attending
    to each other both ways; the same images again run no encoder."""
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    from tests.model.families import save_tiny_gemma3
    model = (str(tmp_path), *save_tiny_gemma3(tmp_path))
    imgs = [random_image(1), random_image(2, (80, 40))]
    content = [{"type": "image_url", "image_url": {"url": data_url(imgs[0])}}, {"type": "text", "text": "w9"},
               {"type": "image_url", "image_url": {"url": data_url(imgs[1])}}]
    want, n_prompt = _hf_text(model, "w3 <start_of_image>\n<start_of_image>\nw9 w4 w5", imgs)
    engine = LLMEngine(EngineArgs(model[0], dtype="float32", num_kv_blocks=160, block_size=4))
    with serve_in_thread(build_app(engine, served_model_name="m")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        for _ in range(2):
            r = _chat(client, content)
            assert r.choices[0].message.content == want and r.usage.prompt_tokens == n_prompt
        enc = engine.core.scheduler.encoder
        assert engine.core.runner.encoder_runs == 2 and enc.misses == 2     # (the second: a prefix hit past both)
        assert idle(engine)


def test_qwen2_5_vl_over_http_equals_hf(tmp_path):
    """Qwen2.5-VL (model/qwen2_5_vl.py) behind the same API: two images of different sizes in one chat message
    are written as Qwen's template writes image parts (<|vision_start|><|image_pad|><|vision_end|>, no newline),
    expanded to their grids' token counts, and give HF's greedy text and prompt length with M-RoPE positions
    past both; the same images again run no encoder."""
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    from tests.model.families import qwen_vl_inputs, save_tiny_qwen2_5_vl
    hf, images, tok = save_tiny_qwen2_5_vl(tmp_path)
    imgs = [random_image(1), random_image(2, (80, 40))]          # 6 x 5 and 5 x 10 image tokens
    content = [{"type": "image_url", "image_url": {"url": data_url(imgs[0])}}, {"type": "text", "text": "w9"},
               {"type": "image_url", "image_url": {"url": data_url(imgs[1])}}]
    tag = "<|vision_start|><|image_pad|><|vision_end|>"
    inp = qwen_vl_inputs(images, tok, f"w3 {tag}{tag}w9 w4 w5", imgs)
    with torch.inference_mode():
        out = hf.generate(**inp, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    n_prompt = inp["input_ids"].shape[1]
    want = tok.decode(out[0, n_prompt:].tolist(), skip_special_tokens=True)
    assert len(want.split()) >= 4, want                # (mostly words, not special tokens dropped from the text)
    engine = LLMEngine(EngineArgs(str(tmp_path), dtype="float32", num_kv_blocks=160, block_size=4))
    with serve_in_thread(build_app(engine, served_model_name="m")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        for _ in range(2):
            r = _chat(client, content)
            assert r.choices[0].message.content == want and r.usage.prompt_tokens == n_prompt
        assert engine.core.runner.encoder_runs == 2 and engine.core.scheduler.encoder.misses == 2
        assert idle(engine)
