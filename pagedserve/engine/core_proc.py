"""The engine core in a process of its own (vLLM v1's EngineCore process), behind the core's protocol
(engine/wire.py) over one duplex pipe.

The core's side (`core_main`, in the spawned process): build the core from the EngineArgs, send `Ready` (its
EngineInfo) once, then loop: take every message waiting (add, finish, calls: each call answered by a Reply),
step while there is work and send each step's StepOutput, and, idle, build the GEMM shapes left from the load
or wait for the next message. A thread sends a Heartbeat every HEARTBEAT_S whatever the loop is doing. The pipe
closing (the frontend gone) ends it.

The frontend's side (`ProcClient`): a reader thread takes every message off the pipe: StepOutputs queue up for
`step`, Replies resolve the Call waiting for them, the latest StatsUpdate is what `stats` reads (the per-step
readers, /metrics, need no round trip: one would wait out the core's current step every step). The core is
dead when the pipe breaks (the process exited: kill -9 included), when nothing, not even a heartbeat, came
for HEARTBEAT_TIMEOUT_S, or when it says so (CoreDied); then `step`, `check_alive` and every call raise
EngineDeadError, and AsyncLLMEngine fails every open request with it (the server turns unhealthy and exits 1).

Not yet: back-pressure (a frontend that stops taking steps lets StepOutputs queue up on its side, unbounded);
grammar precompiles run in the core's loop (a Call), between its steps, not in the server's workers."""
from __future__ import annotations

import atexit
import itertools
import logging
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

from pagedserve.config import EngineArgs
from pagedserve.engine.core_client import CoreClient, handle
from pagedserve.engine.startup import Background, StartupTimer
from pagedserve.engine.info import CoreStats
from pagedserve.engine.outputs import StepStats
from pagedserve.engine.views import core_stats
from pagedserve.engine.wire import (AddRequest, Call, Control, CoreDied, CoreError, FinishRequests, GetStats, Heartbeat,
                                    Ready, Reply, Shutdown, StatsUpdate, StepOutput, decode, encode)
from pagedserve.errors import EngineDeadError

log = logging.getLogger("pagedserve")

HEARTBEAT_S = 1.0               # the core's heartbeat period
HEARTBEAT_TIMEOUT_S = 15.0      # silence after which the frontend declares the core dead
STEP_WAIT_S = 0.02              # how long `step` waits for a StepOutput before handing back to its caller
IDLE_POLL_S = 0.5               # an idle core's wait for a message


class _Sender:
    """One side's sends: whole frames, one thread at a time."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> None:
        data = encode(msg)
        with self.lock:
            self.conn.send_bytes(data)


# ---------------------------------------------------------------- the core's process

def core_main(args: EngineArgs, conn, warm_at_load: bool, log_level: int, setup=None) -> None:
    """The spawned process's whole life. setup: a module-level function run on the built core before Ready
    (bench/host_overhead.py's fake device)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [core]: %(message)s")
    # the frontend decides when the core ends (Shutdown after its drain, or its pipe closing): a terminal's
    # Ctrl-C or a supervisor's SIGTERM to the whole group must not kill the core under a draining server
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pagedserve.engine.core_client import build_core
    from pagedserve.engine.views import engine_info
    out = _Sender(conn)
    try:
        core = build_core(args, None, warm_at_load)
        info = engine_info(core)
        if setup is not None:
            setup(core)
    except BaseException as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        out.send(Ready(None, error=f"{type(e).__name__}: {text}"))
        return
    if core.images is not None:
        core.shutdown()
        out.send(Ready(None, error="ValueError: engine_process: a vision-language model's images do not cross the "
                                   "engine core's protocol; run it with --no-engine-process"))
        return
    out.send(Ready(info, tuple(core.startup.phases)))
    threading.Thread(target=_beat, args=(out,), name="pagedserve-heartbeat", daemon=True).start()
    try:
        _loop(core, conn, out)
    except (EOFError, OSError):             # the frontend is gone: nobody to serve
        pass
    except BaseException as e:
        log.critical("the engine core's loop broke", exc_info=e)
        out.send(CoreDied(str(e) if isinstance(e, EngineDeadError) else
                          f"the engine core's loop broke: {type(e).__name__}: {e}"))
    finally:
        core.shutdown()


def _beat(out: _Sender) -> None:
    try:
        while True:
            out.send(Heartbeat())
            time.sleep(HEARTBEAT_S)
    except (OSError, ValueError):           # the pipe closed: the process is ending
        pass


def _loop(core, conn, out: _Sender) -> None:
    warming = True
    while True:
        busy = core.has_unfinished() or warming
        if conn.poll(0 if busy else IDLE_POLL_S):
            while conn.poll(0):
                msg = decode(conn.recv_bytes())
                if isinstance(msg, Shutdown):
                    return
                _serve(core, msg, out)
        if core.has_unfinished():
            o = core.step()
            out.send(StepOutput(o, core.last_stats))
            out.send(StatsUpdate(replace(core_stats(core), step=StepStats())))
        elif warming:
            warming = core.warm_idle()


def _serve(core, msg, out: _Sender) -> None:
    if not isinstance(msg, Call):           # add / finish without a reply: nothing to say
        handle(core, msg)
        return
    try:
        value, error = handle(core, msg.msg), None
    except Exception as e:                  # the caller's to raise (ParamError, QueueFullError, ...)
        value, error = None, CoreError.of(e)
    out.send(Reply(msg.call_id, value, error))


# ---------------------------------------------------------------- the frontend's client

class ProcClient(CoreClient):
    """The core in its own process; this side loads its own tokenizer (the frontend's: text in and out)."""

    def __init__(self, args: EngineArgs, spawned, startup: StartupTimer | None = None):
        """spawned: the core's process, started by engine/core_spawn.py's spawn_core (a SpawnedCore: serve
        starts it before its own imports, LLMEngine when it makes this client) with these args; this side
        waits for its Ready."""
        from pagedserve.model.source import resolve_model
        from pagedserve.tokenizer import load_tokenizer
        self.startup = startup or StartupTimer()
        self.proc, self._conn = spawned.proc, spawned.conn
        self._out = _Sender(self._conn)
        self._closed = False
        atexit.register(self.shutdown)      # before multiprocessing's own exit hook joins the process
        tokenizer = Background(load_tokenizer, resolve_model(args.model, args.revision))
        try:
            ready = self._wait_ready()
            self.tokenizer = tokenizer.result()
        except BaseException:
            self.shutdown()
            raise
        self.info = ready.info
        self.startup.mark("engine core process")      # this side's wait for the core's Ready (its load beside)
        self.startup.beside.extend(ready.phases)
        self.startup.done()
        log.info("%s", self.startup.summary())
        self.dead: EngineDeadError | None = None
        self._steps: queue.Queue[StepOutput | EngineDeadError] = queue.Queue()
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._stats: CoreStats | None = None   # the core's state after its latest step (StatsUpdate)
        self._lock = threading.Lock()       # orders calls against the core's death
        self._reader = threading.Thread(target=self._read, name="pagedserve-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> Ready:
        self.startup.current = "engine core process"
        while not self._conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited while loading (exit code {self.proc.exitcode})")
        msg = decode(self._conn.recv_bytes())
        if not isinstance(msg, Ready) or msg.info is None:
            reason = msg.error if isinstance(msg, Ready) else f"a {type(msg).__name__} before Ready"
            kind, _, text = (reason or "").partition(": ")
            raise (ValueError if kind == "ValueError" else RuntimeError)(text or reason)
        return msg

    # ------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        try:
            while True:
                if not self._conn.poll(HEARTBEAT_TIMEOUT_S):
                    return self._die(f"the engine core process sent nothing, not even a heartbeat, for "
                                     f"{HEARTBEAT_TIMEOUT_S:g} s")
                msg = decode(self._conn.recv_bytes())
                if isinstance(msg, StepOutput):
                    self._steps.put(msg)
                elif isinstance(msg, Reply):
                    fut = self._calls.pop(msg.call_id, None)
                    if fut is not None:
                        fut.set_exception(msg.error.exception()) if msg.error else fut.set_result(msg.value)
                elif isinstance(msg, StatsUpdate):
                    self._stats = msg.stats
                elif isinstance(msg, CoreDied):
                    return self._die(msg.message)
        except (EOFError, OSError, ValueError):
            if self._closed:
                return
            self.proc.join(1)
            self._die(f"the engine core process exited (exit code {self.proc.exitcode})")

    def _die(self, message: str) -> None:
        err = EngineDeadError(f"engine is dead: {message}")
        with self._lock:
            if self.dead is not None:
                return
            self.dead = err
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_exception(err)
        self._steps.put(err)
        log.critical("%s", err)

    # ------------------------------------------------------------ the door
    def add(self, msg: AddRequest) -> Future:
        return self._start(msg)             # its Reply: None, or the core's ParamError / QueueFullError

    def finish(self, msg: FinishRequests) -> None:
        self.check_alive()
        self._out.send(msg)

    def step(self) -> StepOutput | None:
        try:
            item = self._steps.get(timeout=STEP_WAIT_S)
        except queue.Empty:
            return None
        if isinstance(item, EngineDeadError):
            self._steps.put(item)           # every later step hears it too
            raise item
        return item

    def has_unfinished(self) -> bool:
        return not self._steps.empty()

    def call(self, msg: Control):
        return self._start(msg).result()

    def _start(self, msg: Control) -> Future:
        fut: Future = Future()
        with self._lock:
            if self.dead is not None:
                raise self.dead
            call_id = next(self._ids)
            self._calls[call_id] = fut
        self._out.send(Call(call_id, msg))
        return fut

    def stats(self, shared: bool = False) -> CoreStats:
        """The state the core sent after its latest step (no round trip; a Call before the first, or shared)."""
        s = self._stats
        return s if s is not None and not shared else self.call(GetStats(shared))

    def check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self._out.send(Shutdown())
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()
