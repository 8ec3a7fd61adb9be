"""The engine core's protocol: the messages that cross the door (engine/info.py) between the frontend and its
core, in one process (engine/core_client.py) or two (engine/core_proc.py). Typed records, values only:

- in: `AddRequest` (a tokenized request: token ids, sampling or pooling params, its resolved limits) and
  `FinishRequests` (sequences the frontend ends: an abort, a stop string, a failure); the named queries and
  commands as `Call`s (`GetStats`, `GetView`, `CheckFits`, `Precompile`, `LoadLora`, `UnloadLora`,
  `Shutdown`), each answered by one `Reply` with its value or a `CoreError`;
- out, one per step: `StepOutput` (each sequence's new token ids with their requested logprobs and finish,
  prompt logprobs, pooled embeddings, the step's failures) and the step's one `StepStats` record; once at
  start `Ready` (the EngineInfo); after each step `StatsUpdate` (CoreStats); `Heartbeat` while the core
  lives; `CoreDied` when its loop breaks.

`encode` / `decode`: StepOutput, the one message of every step, as msgpack arrays (engine/step_codec.py);
the rest as pickle protocol 5 bytes read back through an Unpickler that admits only the classes listed here
(bytes from a peer never name an arbitrary callable). The rest are rare (once per request or per query),
and pickle carries SamplingParams' thirty fields and EngineInfo's nested configs with no codec per class.
The two tell apart by their first byte (pickle's PROTO opcode 0x80; a msgpack array starts 0x90-0x9f or
0xdc). Measured by bench/wire_codec.py (numbers in its docstring). Not carried: a prompt's images
(MMFeature pixels): a vision-language model runs in process."""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

from pagedserve.config import SpeculativeConfig
from pagedserve.core.request import Request
from pagedserve.core.traffic import TrafficClass, TrafficClasses
from pagedserve.engine.info import CoreStats, EncoderCacheTotals, EngineInfo, SpecTotals
from pagedserve.engine.outputs import EngineCoreOutputs, EngineCounters, RequestFailure, SeqTimes, SeqToken, StepStats
from pagedserve.engine.startup import Phase
from pagedserve.engine.step_codec import decode_step, encode_step
from pagedserve.errors import EngineDeadError, ParamError, QueueFullError
from pagedserve.lora_request import LoRARequest
from pagedserve.core.step import Logprob
from pagedserve.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams


@dataclass(slots=True, frozen=True)
class AddRequest:
    """A request the frontend tokenized and resolved: what the core's Request is built from."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int                          # resolved (params.max_tokens or what max_model_len leaves)
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    traffic_class: int = 0                   # its class's rank (EngineInfo.traffic_classes)
    num_samples: int = 1
    arrival_time: float = 0.0                # the frontend's monotonic clock
    generator_seed: int | None = None
    lora_id: int = 0
    pooling: PoolingParams | None = None     # an embedding request: its resolved pooling
    lora: LoRARequest | None = None          # its adapter by name (the core resolves it to its id, loading it)
    mm_features: tuple = ()                  # a prompt's images: in process only (not encoded)

    @classmethod
    def of(cls, req: Request) -> AddRequest:
        return cls(req.request_id, tuple(req.prompt_token_ids), req.params, req.max_tokens, tuple(req.eos_token_ids),
                   req.priority, req.traffic_class, req.num_samples, req.arrival_time, req.generator_seed,
                   req.lora_id, req.pooling, mm_features=tuple(req.mm_features))

    def request(self, lora_id: int | None = None) -> Request:
        """The core's Request for it (a new one: its state is the core's from here on); lora_id: what the
        core resolved `lora` to."""
        req = Request(self.request_id, list(self.prompt_token_ids), self.params, self.max_tokens,
                      tuple(self.eos_token_ids), self.priority, self.traffic_class, self.arrival_time,
                      num_samples=self.num_samples, generator_seed=self.generator_seed,
                      lora_id=self.lora_id if lora_id is None else lora_id)
        req.pooling = self.pooling
        req.mm_features = self.mm_features
        return req


@dataclass(slots=True, frozen=True)
class FinishRequests:
    """Sequences the frontend ends now, with their finish status (RequestStatus' value: "abort", "stop",
    "error"). Ids the core does not know (ended, or forks not made yet) are skipped."""

    seq_ids: tuple[str, ...]
    status: str


@dataclass(slots=True, frozen=True)
class StepOutput:
    """One step of the core: its outputs (tokens with logprobs and finish, prompt logprobs, embeddings,
    failures) and its one stats record."""

    outputs: EngineCoreOutputs
    stats: StepStats


@dataclass(slots=True, frozen=True)
class GetStats:
    """-> CoreStats (shared: also the blocks sharing saved, a walk over the pool)."""
    shared: bool = False


@dataclass(slots=True, frozen=True)
class GetView:
    """-> a dict: "scheduler" (/debug/scheduler), "cache" (the dashboard's pool), "held" (per-request
    entries), "loras" (loaded adapters' (name, path) pairs), "lora_names" (their names, a frozenset)."""
    name: str


@dataclass(slots=True, frozen=True)
class CheckFits:
    """-> None, or ParamError when such a prompt with max_tokens could never run."""
    prompt_len: int
    max_tokens: int


@dataclass(slots=True, frozen=True)
class Precompile:
    """-> None, or ParamError for a bad constraint."""
    params: SamplingParams | PoolingParams


@dataclass(slots=True, frozen=True)
class LoadLora:
    name: str
    path: str


@dataclass(slots=True, frozen=True)
class UnloadLora:
    """-> False when no adapter has that name."""
    name: str


@dataclass(slots=True, frozen=True)
class Shutdown:
    """The core stops its workers and its loop ends (no reply)."""


Control = GetStats | GetView | CheckFits | Precompile | LoadLora | UnloadLora | AddRequest


@dataclass(slots=True, frozen=True)
class Call:
    """A message that wants its Reply (the same call_id)."""
    call_id: int
    msg: Control


@dataclass(slots=True, frozen=True)
class CoreError:
    """An exception raised in the core for a Call, as values; `exception()` raises it on this side."""
    kind: str                                # "ParamError" | "QueueFullError" | "ValueError" | "EngineDeadError"
    message: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, e: Exception) -> CoreError:
        if isinstance(e, ParamError):
            return cls("ParamError", str(e), e.param, e.code)
        kind = next((k for k in _ERRORS if type(e).__name__ == k), "EngineDeadError")
        text = str(e) if kind != "EngineDeadError" or isinstance(e, EngineDeadError) else \
            f"the engine core failed a call: {type(e).__name__}: {e}"
        return cls(kind, text)

    def exception(self) -> Exception:
        if self.kind == "ParamError":
            return ParamError(self.param or "", self.message, self.code)
        return _ERRORS[self.kind](self.message)


_ERRORS = {"QueueFullError": QueueFullError, "ValueError": ValueError, "EngineDeadError": EngineDeadError}


@dataclass(slots=True, frozen=True)
class Reply:
    call_id: int
    value: object = None
    error: CoreError | None = None


@dataclass(slots=True, frozen=True)
class Ready:
    """The core is built: what the frontend may know of it, and its start-up phases (in its process)."""
    info: EngineInfo | None
    phases: tuple[Phase, ...] = ()
    error: str | None = None                 # the build failed: why, in one line (info None)


@dataclass(slots=True, frozen=True)
class Heartbeat:
    """The core lives (sent every HEARTBEAT_S, from a thread of its own, whatever the loop does)."""


@dataclass(slots=True, frozen=True)
class StatsUpdate:
    """The core's state after a step (its `step` left empty: the StepOutput carries that), sent after each
    StepOutput so the per-step readers (/metrics) need no round trip."""
    stats: CoreStats


@dataclass(slots=True, frozen=True)
class CoreDied:
    """The core's loop broke (the scheduler failed, a rank died): its state is unknown."""
    message: str


_MESSAGES = (AddRequest, FinishRequests, StepOutput, GetStats, GetView, CheckFits, Precompile, LoadLora, UnloadLora,
             Shutdown, Call, Reply, Ready, Heartbeat, StatsUpdate, CoreDied)
_ALLOWED = {(c.__module__, c.__qualname__) for c in (
    *_MESSAGES, CoreError, EngineCoreOutputs, SeqToken, SeqTimes, RequestFailure, StepStats, Logprob, SamplingParams,
    StructuredOutputsParams, PoolingParams, LoRARequest, EngineInfo, CoreStats, EngineCounters, SpecTotals,
    EncoderCacheTotals, TrafficClasses, TrafficClass, SpeculativeConfig, Phase)} | {("builtins", "frozenset"),
                                                                               ("builtins", "set")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise ValueError(f"data: {module}.{name} is not a message of the engine core's protocol")
        return super().find_class(module, name)


def encode(msg) -> bytes:
    """A message's bytes: StepOutput as msgpack, the rest as pickle 5."""
    if type(msg) is StepOutput:
        return encode_step(msg.outputs, msg.stats)
    if isinstance(msg, AddRequest) and msg.mm_features:
        raise ValueError("mm_features: a prompt's images do not cross the engine core's protocol")
    return pickle.dumps(msg, protocol=5)


def decode(data: bytes):
    """A message from its bytes; ValueError naming `data` for anything but the protocol's messages."""
    if data[:1] != b"\x80":
        return StepOutput(*decode_step(data))
    msg = _Unpickler(io.BytesIO(data)).load()
    if not isinstance(msg, _MESSAGES):
        raise ValueError(f"data: a {type(msg).__name__} is not a message of the engine core's protocol")
    return msg
