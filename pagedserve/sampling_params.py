"""SamplingParams: vLLM's names and semantics; every bad field is a ValueError naming it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                                  # independent samples; they share the prompt's KV blocks
    temperature: float = 0.0                    # 0 = greedy (vLLM's default is 1.0; ours is greedy, like the CLI)
    top_p: float = 1.0
    top_k: int = -1                             # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None                     # per-request generator: same output alone or in any batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)   # output is truncated before the first stop string
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16                 # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None                 # top-k logprobs per generated token (the sampled one is always added)
    prompt_logprobs: None = None                # accepted for compatibility; must stay None
    skip_special_tokens: bool = True
    use_beam_search: bool = False               # beam search of width `best_of or n` (vLLM v0's switch)
    best_of: int | None = None
    length_penalty: float = 1.0                 # beam score = logprob_sum / len ** length_penalty

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def beam_width(self) -> int:
        return (self.best_of or self.n) if self.use_beam_search else 1

    def validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        def num(name: str, integer: bool = False):
            v = getattr(self, name)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if not ok or isinstance(v, bool):
                bad(name, "must be an integer" if integer else "must be a number")
            if not integer and v != v:
                bad(name, "must not be NaN")

        num("n", True)
        if self.n < 1:
            bad("n", "must be at least 1")
        num("temperature")
        if self.temperature < 0:
            bad("temperature", "must be non-negative")
        num("top_p")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        num("top_k", True)
        if self.top_k < -1:
            bad("top_k", "must be -1 (off), 0 (off) or positive")
        num("min_p")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad("seed", "must be an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            num(name)
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        num("repetition_penalty")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.max_tokens is not None:
            num("max_tokens", True)
            if self.max_tokens < 1:
                bad("max_tokens", "must be at least 1")
        num("min_tokens", True)
        if self.min_tokens < 0:
            bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            num("logprobs", True)
            if not 0 <= self.logprobs <= 20:
                bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None:
            bad("prompt_logprobs", "is not supported")
        if self.best_of is not None:
            num("best_of", True)
            if self.best_of < self.n:
                bad("best_of", f"must be at least n ({self.n})")
            if not self.use_beam_search and self.best_of != self.n:
                bad("best_of", "other than n is only supported with use_beam_search")
        num("length_penalty")
        if self.use_beam_search:
            if not self.greedy:
                bad("temperature", "must be 0 with use_beam_search")
            if self.stop:
                bad("stop", "is not supported with use_beam_search")


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's LLM.beam_search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
