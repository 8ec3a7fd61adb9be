"""OpenAI request bodies (pydantic) and the mapping to SamplingParams."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


def to_sampling_params(req: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    def pick(v, default):
        return default if v is None else v
    return SamplingParams(
        n=req.n, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), top_k=pick(req.top_k, -1),
        min_p=pick(req.min_p, 0.0), seed=req.seed, presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0), repetition_penalty=pick(req.repetition_penalty, 1.0),
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, max_tokens=max_tokens,
        min_tokens=req.min_tokens, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens)


def message_text(m: ChatMessage) -> dict:
    content = m.content
    if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if p.get("type") != "text":
                raise ValueError(f"messages: content part type {p.get('type')!r} is not supported (only text)")
            parts.append(str(p.get("text", "")))
        content = "".join(parts)
    return {"role": m.role, "content": content or ""}

