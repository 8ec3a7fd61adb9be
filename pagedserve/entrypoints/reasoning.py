"""`--reasoning-parser qwen3|deepseek_r1` (vLLM's flag): the text a reasoning model writes between
`<think>` and `</think>` goes to the message's `reasoning_content`, the rest to `content`.

qwen3: reasoning only when the output opens with `<think>` (with `enable_thinking: false` the
template makes the model skip it). deepseek_r1: its template already wrote `<think>` into the
prompt, so the output starts inside the reasoning (an opening tag, if written, is dropped).
Either way an output cut off before `</think>` is all reasoning, in the stream and at the end alike.
"""
from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    body = text.lstrip()
    if body.startswith(START):
        body = body[len(START):]
    elif parser == "qwen3":
        return None, text
    else:                        # deepseek_r1: the output starts inside the reasoning
        body = text
    reasoning, _, content = body.partition(END)
    return reasoning, content


class ReasoningStream:
    """Splits a stream of text deltas the same way `split` splits the whole, holding back only what
    could still be the start of a tag (so a tag cut across two chunks is never sent as text)."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self.sent = (0, 0)       # characters of reasoning and of content already sent

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for this chunk of text; `final` flushes what was held."""
        self.text += delta
        if not final and START.startswith(self.text.lstrip()):
            return "", ""                        # may still become "<think>"
        reasoning, content = split(self.parser, self.text)
        if reasoning is not None and not final and END not in self.text:
            reasoning = _hold_tag_prefix(reasoning, END)
        r0, c0 = self.sent
        reasoning = reasoning or ""
        self.sent = (max(r0, len(reasoning)), max(c0, len(content)))
        return reasoning[r0:], content[c0:]


def _hold_tag_prefix(text: str, tag: str) -> str:
    """text without a trailing partial `tag` (e.g. "...</th")."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text
