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
