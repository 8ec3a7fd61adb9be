"""OpenAI request bodies (pydantic) and the mapping to SamplingParams."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedserve.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_TOP_K, SamplingParams

INT32_MAX = 2**31 - 1


def check_utf8(value: Any) -> Any:
    """JSON may carry lone surrogates ("\\ud800") that no tokenizer can encode: reject them here."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("contains a lone surrogate (not valid Unicode text)") from None
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_utf8(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_utf8(k)
            check_utf8(v)
    return value


class _Body(BaseModel):
    """Every number finite, every string valid Unicode: a bad field is a 400 that names it."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, v: Any) -> Any:
        return check_utf8(v)


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = None
    n: int = Field(1, ge=1, le=INT32_MAX)          # at most max_num_seqs: checked against the engine
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
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

