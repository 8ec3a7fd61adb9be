import pytest

from pagedserve.tokenizer import IncrementalDetokenizer, apply_chat_template


def test_chat_template_from_gguf(tokenizer):
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hello"}])
    text = tokenizer.decode(ids)
    assert "<|im_start|>user\nhello<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_incremental_detokenization_across_multibyte_characters(tokenizer):
    text = "Grüße aus Köln 🌍🚀 — 日本語のテキスト, ok."
    ids = tokenizer(text)["input_ids"]
    # some characters span several byte-level tokens: the detokenizer must not emit half of one
    partial = [tokenizer.decode(ids[:i]) for i in range(1, len(ids))]
    assert any(p.endswith("\ufffd") for p in partial)
    d = IncrementalDetokenizer(tokenizer)
    deltas = [d.add(t) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


@pytest.mark.parametrize("kind", ["light", "transformers"])
def test_many_threads_tokenize_template_and_detokenize_at_once(tokenizer, kind):
    """The server calls one tokenizer from its worker threads, the event loop and the engine thread. A
    transformers fast tokenizer's encode path sets truncation / padding on its Rust object, and concurrent
    calls raised "Already borrowed": SerialTokenizer takes them one at a time. The light tokenizer never
    writes to its Rust object after it is built, so it needs no lock. Every thread's results equal the
    serial ones."""
    import threading
    from pagedserve.light_tokenizer import LightTokenizer
    from pagedserve.tokenizer import SerialTokenizer
    assert isinstance(tokenizer, LightTokenizer)
    if kind == "transformers":
        tokenizer = SerialTokenizer(tokenizer.transformers())
    mutating = {"truncation": True} if kind == "transformers" else {}
    texts = [f"request {i}: " + "Grüße aus Köln 🌍 " * (1 + i % 7) for i in range(24)]

    def work(i):
        t = texts[i]
        ids = tokenizer(t, **mutating, **({"max_length": 8 + i} if mutating else {}))["input_ids"]
        chat = apply_chat_template(tokenizer, [{"role": "user", "content": t}])
        full = tokenizer.encode(t, add_special_tokens=False)
        d = IncrementalDetokenizer(tokenizer)
        streamed = "".join(d.add(x) for x in full) + d.flush()
        return ids, chat, tokenizer.decode(full), streamed

    want = [work(i) for i in range(len(texts))]
    got, errors = [None] * len(texts), []
    start = threading.Barrier(len(texts))

    def run(i):
        start.wait()
        try:
            for _ in range(5):
                got[i] = work(i)
        except Exception as e:          # noqa: BLE001 -- any failure is the test's
            errors.append(repr(e))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == want
    assert all(w[3] == texts[i] == w[2] for i, w in enumerate(want))
