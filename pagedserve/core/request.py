"""A request as the scheduler sees it: token ids, one progress counter, a status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class MMFeature:
    """One image of a prompt: its content hash, and the prompt positions offset..offset+length-1 its
    encoder vectors fill. `data` is what the runner's encoder reads (its pixels; opaque here). `grid`:
    M-RoPE (Qwen2.5-VL) only, the (rows, cols) its vectors lie in, which set its tokens' positions and
    those of everything after it (`rope_shift`); () elsewhere."""

    hash: str
    offset: int
    length: int
    data: Any = field(default=None, compare=False, repr=False)
    grid: tuple[int, ...] = ()

    @property
    def rope_shift(self) -> int:
        """What the image adds to the rotary positions of the tokens after it: they go on from its first
        position + max(rows, cols) rather than + length (HF's get_rope_index); 0 without a grid."""
        return max(self.grid) - self.length if self.grid else 0

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


def rope_shift(features: tuple[MMFeature, ...], pos: int) -> int:
    """A text token's rotary position at index `pos` minus `pos`: the shifts of the images wholly before it
    (M-RoPE; 0 for every other model). Decode tokens follow the last image: HF's rope_deltas."""
    return sum(f.rope_shift for f in features if f.end <= pos)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"            # blocks dropped; re-prefills from token 0 when readmitted
    SWAPPED = "swapped"                # blocks copied to the host tier; copied back when readmitted
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"         # the client went away, or an explicit abort
    FINISHED_ERROR = "error"           # the engine failed this request (a fault in its step, a timeout)

    @property
    def finished(self) -> bool:
        return self in _FINISHED


@dataclass(slots=True, eq=False)
class Request:
    """No prefill or decode phase: `num_computed_tokens` alone says how far the request got, so chunked
    prefill, mixed batches, prefix hits and recompute after preemption are one code path."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                              # resolved: params.max_tokens or what max_model_len allows
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0                            # lower is served first (within its traffic class)
    traffic_class: int = 0                       # rank of its class (core/traffic.py; 0 without classes)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0                         # FCFS tie-break, set by the scheduler
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1                  # prefix-cache hit at first admission (-1: not admitted yet)
    num_samples: int = 1                         # >1: the first sample forks into n sequences sharing blocks
    seq_index: int = 0                           # which of the n samples this sequence is
    parent_id: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator_seed: int | None = None
    grammar: Any = None                          # structured outputs: the sequence's matcher (core/grammar.py)
    prompt_logprobs_done: int = 0                # prompt positions whose logprobs were scheduled (never twice)
    pooling: Any = None                          # an embedding request: its resolved PoolingParams
    pooled_done: int = 0                         # prompt positions whose hidden states were pooled (never twice)
    spec_tried: float = 0.0                      # speculative decoding: draft tokens tried, decayed (spec_decode.py)
    spec_accepted: float = 0.0                   # ... and accepted
    spec_length: int = 0                         # the n-gram length of its latest draft (0: a draft model's)
    num_draft_computed: int = 0                  # speculative draft_model: positions the draft model's KV holds
    lora_id: int = 0                             # its LoRA adapter (the engine's id for it; 0: the base model)
    mm_features: tuple[MMFeature, ...] = ()      # images in the prompt, by position (vision-language models)
    # timestamps (monotonic seconds) for latency metrics
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def sort_key(self) -> tuple[int, int, int, int]:
        """A total order: class first, then priority; the n samples of one request share priority and
        arrival, so the sample index breaks the tie (two queue entries never compare equal)."""
        return (self.traffic_class, self.priority, self.arrival_seq, self.seq_index)

    @property
    def num_pending_forks(self) -> int:
        """Sequences this request will add when its first token is sampled (n > 1)."""
        return self.num_samples - 1 if self.num_samples > 1 and not self.output_token_ids else 0

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                       RequestStatus.FINISHED_ERROR})


def fork_id(request_id: str, i: int) -> str:
    """Sample i's sequence id of an n > 1 request (i >= 1; sample 0 is the request's own id)."""
    return f"{request_id}#{i}"


def owner_id(req: Request) -> str:
    """The user request a sequence belongs to: its first sequence carries the request's id."""
    return req.parent_id or req.request_id
