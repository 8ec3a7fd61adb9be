"""SamplingParams: vLLM's names and semantics; every bad field is a ValueError naming it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagedserve.errors import ParamError

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20                 # OpenAI's limit for logprobs / top_logprobs
MAX_STOP_STRINGS = 64             # every new token is checked against each one
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024             # entries per request (each is a scatter into the row's logits)


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output (vLLM's names): exactly one of a JSON schema, any JSON object, a regex, one
    of a list of strings, or a Lark grammar. Enforced as a token mask by `pagedserve.core.grammar`."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"           # the request field it came from, named in errors
    compiled: Any = field(default=None, repr=False, compare=False)   # a matcher compiled ahead (see grammar.py)

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ParamError(self.param, f"{self.param}: give exactly one of json, json_object, regex, choice, "
                                         f"grammar (got {', '.join(kinds) or 'none'})")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ParamError(self.param, f"{self.param}: choice must be a non-empty list of strings")
        for k in ("regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise ParamError(self.param, f"{self.param}: {k} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ParamError(self.param, f"{self.param}: json must be a JSON schema (an object or its text)")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                                  # independent samples; they share the prompt's KV blocks
    temperature: float = 0.0                    # 0 = greedy (vLLM's default is 1.0; ours is greedy, like the CLI)
    top_p: float = 1.0
    top_k: int = -1                             # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None                     # per-request generator (int64): same output alone or in any batch
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
    prompt_logprobs: int | None = None          # top-k logprobs per prompt token (the prompt's own token is added)
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True                     # False: token ids only, no text
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
            v = repr(getattr(self, name))
            raise ParamError(name, f"{name} {why}, got {v if len(v) < 80 else v[:77] + '...'}")

        def num(name: str, integer: bool = False):
            v = getattr(self, name)
            ok = isinstance(v, int) if integer else isinstance(v, (int, float))
            if not ok or isinstance(v, bool):
                bad(name, "must be an integer" if integer else "must be a number")
            if not integer and not math.isfinite(v):
                bad(name, "must be a finite number")

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
        if not -1 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be -1 (off), 0 (off) or a positive integer up to {MAX_TOP_K}")
        num("min_p")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None:
            num("seed", True)
            if not INT64_MIN <= self.seed <= INT64_MAX:
                bad("seed", "must fit in a signed 64-bit integer")
        for name in ("presence_penalty", "frequency_penalty"):
            num(name)
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        num("repetition_penalty")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10]")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
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
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            num("prompt_logprobs", True)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            self._check_logit_bias(bad)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.structured_outputs is not None and self.min_tokens:
            bad("min_tokens", "must be 0 with structured_outputs (the grammar decides where the output ends)")
        if not self.detokenize and self.stop:
            bad("stop", "needs detokenize=True (stop strings are matched in the text)")
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


    def _check_logit_bias(self, bad) -> None:
        lb = self.logit_bias
        if not isinstance(lb, dict):
            bad("logit_bias", "must map token ids to biases")
        if len(lb) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} entries")
        for t, b in lb.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                bad("logit_bias", f"keys must be non-negative token ids ({t!r} is not)")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
                bad("logit_bias", f"biases must be numbers in [-100, 100] ({t}: {b!r} is not)")


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


POOLING_TYPES = ("LAST", "MEAN", "CLS")            # a decoder's pooled hidden states
ENCODER_POOLING_TYPES = POOLING_TYPES + ("MAX",)   # an encoder (EncoderCore) also pools the max of each dimension


@dataclass(slots=True)
class PoolingParams:
    """What an embedding request returns (vLLM's PoolingParams; `LLM.embed`, `/v1/embeddings`): the
    model's final hidden states over the prompt pooled by `pooling_type` (LAST token, MEAN of all, or
    CLS: the first), L2-normalized unless `normalize` is False, and cut to the first `dimensions`
    values (normalized again after the cut) when given. None: the model's own (its sentence-transformers
    pooling config, or --pooling; else LAST, normalized)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in ENCODER_POOLING_TYPES:
                raise ParamError("pooling_type", f"pooling_type must be one of {ENCODER_POOLING_TYPES}, got "
                                                 f"{self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParamError("normalize", f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ParamError("dimensions", f"dimensions must be a positive integer, got {self.dimensions!r}")

    def resolved(self, default_type: str | None, model: dict, hidden_size: int,
                 supported: tuple[str, ...] = POOLING_TYPES) -> PoolingParams:
        """These params with the model's defaults filled in (`default_type`: --pooling; `model`: its
        sentence-transformers config; else LAST, normalized); a ParamError for what this model cannot give
        (`supported`: the poolings its core computes)."""
        kind = self.pooling_type or (default_type or "").upper() or model.get("pooling_type") or "LAST"
        if kind not in supported:
            which = "the model's pooling" if not self.pooling_type else "pooling"
            raise ParamError("pooling_type", f"pooling_type: {which} {kind!r} is not supported for this model "
                                             f"(supported: {', '.join(supported)}; choose one with --pooling)")
        normalize = self.normalize if self.normalize is not None else model.get("normalize", True)
        if self.dimensions is not None:
            allowed = model.get("matryoshka")            # None: not trained for truncation; []: any size
            if allowed is None or (self.dimensions not in allowed if allowed else self.dimensions > hidden_size):
                names = "no matryoshka dimensions" if allowed is None else f"matryoshka_dimensions {allowed or 'any'}"
                raise ParamError("dimensions", f"dimensions: this model does not make {self.dimensions}-dimensional "
                                               f"embeddings (its config names {names}; hidden size {hidden_size})")
        return PoolingParams(kind, normalize, self.dimensions)
