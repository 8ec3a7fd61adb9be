"""What the engine hands back: vLLM's RequestOutput / CompletionOutput, and per-step statistics."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedserve.core.record import record
from pagedserve.core.step import Logprob


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None        # "stop" | "length" | "abort" (client left) | "error" (see RequestOutput.error)
    # a streaming request's outputs carry deltas: text, token_ids and logprobs new since the last one
    stop_reason: int | str | None = None    # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None

    def after(self, earlier: CompletionOutput) -> CompletionOutput:
        """This delta with an earlier one of the same sequence put in front (text, tokens, logprobs)."""
        return replace(self, text=earlier.text + self.text, token_ids=earlier.token_ids + self.token_ids,
                       logprobs=None if self.logprobs is None else (earlier.logprobs or []) + self.logprobs)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    traffic_class: int = 0                  # rank of its traffic class (0 without --traffic-classes)


@dataclass(slots=True, frozen=True)
class RequestFailure:
    """Why the engine failed a request (finish reason "error"); the server maps `kind` to a status."""

    kind: str          # "internal_error" | "timeout" | "shutdown" | "engine_dead"
    message: str


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: RequestFailure | None = None      # set when the engine failed the request
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it);
    # a stream carries it once, in the first output after the prompt is done
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None     # an embedding request (PoolingParams): the pooled vector, once finished


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two successive deltas of one streaming request as one delta (what a client that fell behind
    receives): each sequence's text, tokens and logprobs joined, the later finish state and metrics."""
    earlier = {o.index: o for o in a.outputs}
    outs = []
    for o in b.outputs:
        p = earlier.pop(o.index, None)
        outs.append(o if p is None else o.after(p))
    outs = sorted(outs + list(earlier.values()), key=lambda o: o.index)
    return replace(b, outputs=outs, prompt_logprobs=b.prompt_logprobs if b.prompt_logprobs is not None
                   else a.prompt_logprobs)


@record
class SeqTimes:
    """A sequence's progress as the core saw it at a token (what RequestMetrics reports)."""

    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0              # its prompt's prefix-cache hit


@dataclass(slots=True)
class SeqToken:
    """One new token of one sequence, as the core applied it (EngineCore.step): values, no core objects."""

    seq_id: str
    owner_id: str                           # the user request's id (its first sequence's)
    seq_index: int                          # which of the request's n samples
    token_id: int
    logprobs: dict[int, Logprob] | None
    finish: str | None                      # the core ended the sequence here: "stop" (EOS, stop token, grammar) | "length"
    stop_reason: int | None                 # the stop token that ended it
    times: SeqTimes


@dataclass(slots=True)
class EngineCoreOutputs:
    """What one core step hands its frontend."""

    tokens: list[SeqToken] = field(default_factory=list)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)   # request id -> this step's chunk of them
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # request id -> its finished pooled vector
    failed: tuple[str, ...] = ()            # requests whose step failed: the frontend ends them with `error`
    error: RequestFailure | None = None


@dataclass(slots=True)
class StepStats:
    """One engine step, as the scheduler and runner saw it (read by /metrics and the benchmarks)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preempted_waiting: int = 0          # waiting because they were preempted (recompute or swap)
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_blocks: int = 0              # blocks registered in the prefix cache (in use or evictable)
    kv_usage: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0                # preemptions during this step
    num_admitted: int = 0                   # waiting requests that joined the batch this step
    num_draft_tokens: int = 0               # speculative decoding: draft tokens verified this step
    step_s: float = 0.0
    forward_s: float = 0.0
    prepare_s: float = 0.0
    propose_s: float = 0.0                  # speculative draft_model: the draft model's passes (in prepare_s)
    sample_s: float = 0.0
    rows: tuple[tuple[int, int, int], ...] = ()   # each sequence the step ran: (start, tokens, samples)
    index: int = 0                          # the step's number (the core's step count at it; 0: none yet)


@dataclass(slots=True)
class EngineCounters:
    """Running totals since the engine started."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)     # finish reason -> count

    def count_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
