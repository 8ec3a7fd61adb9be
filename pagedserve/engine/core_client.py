"""The frontend's one door to its engine core: `CoreClient`. Everything LLMEngine asks of the core is a message
of the protocol (engine/wire.py): `add` (AddRequest) and `finish` (FinishRequests) in, `step` (StepOutput) out,
the named queries and commands through `call`. Two implementations:

- `InProcClient` (LLM's, and serve's with --no-engine-process): the core in this process, stepped by the
  caller; messages are handed over as objects, never encoded;
- `ProcClient` (engine/core_proc.py): the core in a process of its own, stepping by itself.

`handle` is the core's side of every message, shared by both, so a query means the same in either."""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from pagedserve.core.request import RequestStatus
from pagedserve.config import EngineArgs
from pagedserve.engine.info import CoreStats, EngineInfo
from pagedserve.engine.startup import StartupTimer
from pagedserve.engine.views import cache_view, core_stats, scheduler_view
from pagedserve.engine.wire import (AddRequest, CheckFits, Control, FinishRequests, GetStats, GetView, LoadLora,
                                    Precompile, StepOutput, UnloadLora)
from pagedserve.errors import ParamError
from pagedserve.lora_request import lora_id


def build_core(args: EngineArgs, startup: StartupTimer | None, warm_at_load: bool):
    """The core for these args: an EngineCore, or an EncoderCore for a sentence-transformers encoder (BERT-like:
    it only embeds; its core runs no KV pool)."""
    from pagedserve.engine.core import EngineCore
    from pagedserve.engine.encoder_core import EncoderCore, is_encoder_folder
    from pagedserve.model.loader import resolve_model
    encoder = is_encoder_folder(resolve_model(args.model, args.revision))
    return (EncoderCore if encoder else EngineCore)(args, startup, warm_at_load=warm_at_load)



class CoreClient(ABC):
    """What LLMEngine holds of its core: the frozen EngineInfo, the tokenizer of this side, the start-up record,
    and the protocol's messages."""

    info: EngineInfo
    tokenizer: object
    startup: StartupTimer
    images: object = None                # a vision-language model's image inputs (in process only)

    @abstractmethod
    def add(self, msg: AddRequest) -> Future | None:
        """Queue a request: None when the core took it (ParamError / QueueFullError raised when it did not),
        or a Future of that verdict (the core in another process)."""

    @abstractmethod
    def finish(self, msg: FinishRequests) -> None:
        """End sequences now; a no-op on ended ones."""

    @abstractmethod
    def step(self) -> StepOutput | None:
        """The next step's output (None: none came in the client's wait; the caller tries again)."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Core work the frontend must step for, beyond its own open requests."""

    @abstractmethod
    def call(self, msg: Control):
        """A query or command's value (the core's exception raised here)."""

    def stats(self, shared: bool = False) -> CoreStats:
        """The core's state now (a client may answer from the state its core sent after its latest step)."""
        return self.call(GetStats(shared))

    def warm_idle(self) -> bool:
        """Build a slice of the GEMM shapes left from the load; True while some remain (a core in its own
        process does this in its own idle time: False)."""
        return False

    def check_alive(self) -> None:
        """EngineDeadError once the core is gone (a process exit, a missed heartbeat)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core (its tensor-parallel workers, its process). Idempotent."""


def handle(core, msg):
    """The core's side of one message (add, finish or a Control): its value, or its exception raised."""
    match msg:
        case AddRequest():
            req = msg.request(lora_id(core.loras, msg.lora) if msg.lora is not None else None)
            core.add(req)
        case FinishRequests():
            core.finish(list(msg.seq_ids), RequestStatus(msg.status))
        case GetStats(shared=shared):
            return core_stats(core, shared)
        case GetView(name="scheduler"):
            return scheduler_view(core)
        case GetView(name="cache"):
            return cache_view(core)
        case GetView(name="held"):
            return core.held()
        case GetView(name="lora_names"):   # replaced whole on every load and unload: safe from any thread
            return frozenset() if core.loras is None else core.loras.names
        case GetView(name="loras"):
            return [] if core.loras is None else [(n, e.path) for n, e in core.loras.by_name.items()]
        case CheckFits(prompt_len=n, max_tokens=m):
            core.scheduler.check_fits(n, m)
        case Precompile(params=params):
            core.precompile(params)
        case LoadLora(name=name, path=path):
            _loras(core).load(name, path)
        case UnloadLora(name=name):
            return _loras(core).unload(name)
        case _:
            raise ValueError(f"msg: a {type(msg).__name__} is not a message the engine core handles")
    return None


def _loras(core):
    if core.loras is None:
        raise ParamError("lora_name", "lora_name: the engine runs without LoRA (enable_lora)")
    return core.loras


class InProcClient(CoreClient):
    """The core in this process: each message handled at once, in the caller's thread; `step` runs one."""

    def __init__(self, core, info: EngineInfo):
        self.core, self.info = core, info
        self.tokenizer, self.startup, self.images = core.tokenizer, core.startup, core.images

    def add(self, msg: AddRequest) -> None:
        handle(self.core, msg)

    def finish(self, msg: FinishRequests) -> None:
        handle(self.core, msg)

    def step(self) -> StepOutput:
        out = self.core.step()
        return StepOutput(out, self.core.last_stats)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def call(self, msg: Control):
        return handle(self.core, msg)

    def warm_idle(self) -> bool:
        return self.core.warm_idle()

    def shutdown(self) -> None:
        self.core.shutdown()
