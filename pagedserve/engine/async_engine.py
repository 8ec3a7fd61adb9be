"""AsyncLLMEngine: the engine steps in its own thread; each request gets an asyncio stream.

HTTP handlers never block the step loop: they hand work to the engine thread over one
thread-safe queue and read outputs from a per-request `RequestStream`. After each step the engine
thread hands the step's outputs to the event loop once (one loop.call_soon_threadsafe per step, not
per request); a stream whose client has not taken its last delta yet gets the new one merged into it
(a lagging client receives fewer, larger chunks; nothing queues up behind it). Everything that changes
engine state (add, abort, fail, time out) runs in the engine thread, between steps. A request's stream
is kept in its RequestState (`sink`), in the engine's one registry; the deadline heap is an index into
that registry (entries of ended requests are skipped).

Failures stay local and are reported as failures: a fault in a step fails the requests of that
step (LLMEngine.step); a request older than `request_timeout_s` fails with a timeout; if the
engine thread itself dies, every stream and every pending submission gets EngineDeadError at
once and `on_dead` is called (the server then reports unhealthy and exits)."""
from __future__ import annotations

import asyncio
import heapq
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.lora_request import LoRARequest
from pagedserve.core.request import RequestStatus
from pagedserve.engine.llm_engine import Delivery, LLMEngine
from pagedserve.engine.outputs import RequestFailure, RequestOutput, merge_deltas
from pagedserve.errors import EngineDeadError
from pagedserve.sampling_params import SamplingParams

log = logging.getLogger("pagedserve")


DEADLINES_SLACK = 64        # stale deadline entries tolerated before the heap is rebuilt (_push_deadline)

class RequestStream:
    """One request's outputs in order; the last one is finished. `abort()` (the client went away)
    ends the request in the engine; its final output then says "abort". The event loop's side of
    the hand-off: `push` (in the loop) keeps at most one pending delta per streaming request, merging
    a new one into a delta not taken yet."""

    def __init__(self, aengine: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop,
                 coalesce: bool = True):
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._aengine = aengine
        self._coalesce = coalesce                 # deltas (streaming): merge what the client has not taken
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread (one item; a step's outputs go through AsyncLLMEngine._deliver)."""
        self.loop.call_soon_threadsafe(self.push, item)

    def push(self, item: RequestOutput | BaseException) -> None:
        """In the event loop."""
        items = self._items
        if self._coalesce and items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput):
            items[-1] = merge_deltas(items[-1], item)
        else:
            items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self._aengine.abort(self.request_id)


def _push_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.push(out)


@dataclass(slots=True)
class _Call:
    """A function for the engine thread whose result an asyncio caller awaits."""
    fn: Callable[[], object]
    fut: asyncio.Future

    def __call__(self) -> None:
        try:
            res = self.fn()
        except Exception as e:          # handed to the caller
            self.resolve(e)
            return
        self.fut.get_loop().call_soon_threadsafe(lambda: self.fut.done() or self.fut.set_result(res))

    def resolve(self, error: BaseException) -> None:
        self.fut.get_loop().call_soon_threadsafe(lambda: self.fut.done() or self.fut.set_exception(error))


class AsyncLLMEngine:
    """`start_thread=False` leaves the step loop to the caller's `run()`: `pagedserve serve` steps
    on the main thread, where a step measured ~30% faster than on another thread (small torch CPU
    ops cost up to 4x more there; torch's OpenMP pool is the suspect), and serves HTTP from a thread."""

    def __init__(self, engine: LLMEngine, request_timeout_s: float | None = None, start_thread: bool = True):
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.dead: EngineDeadError | None = None
        self.on_step: Callable | None = None      # (engine, outputs), in the engine thread (metrics)
        self.on_dead: Callable | None = None      # (EngineDeadError), in the engine thread, once
        self.on_stepped: Callable | None = None   # (engine), after each step (the step trace)
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._lock = threading.Lock()             # orders submissions against the engine's death
        self._deadlines: list[tuple[float, str]] = []     # heap over engine.states, engine thread only
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self.run, name="pagedserve-engine", daemon=True) if start_thread else None
        if self._thread is not None:
            self._thread.start()

    # ------------------------------------------------------------ called from asyncio
    async def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0,
                          stream: bool = True, traffic_class: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Submit a request; raises what engine.add_request raises (ParamError, QueueFullError) or
        EngineDeadError. Iterate the returned stream for its outputs: deltas after every step when
        `stream`, else one full output at the end."""
        rs = RequestStream(self, request_id, asyncio.get_running_loop(), coalesce=stream)
        arrival = time.monotonic()

        def add():                       # in the engine thread; an exception reaches the caller, nothing changed
            _, verdict = self.engine.submit(request_id, prompt, params, priority=priority, stream=stream,
                                            arrival_time=arrival, traffic_class=traffic_class,
                                            lora_request=lora_request, sink=rs)
            if self.request_timeout_s is not None:
                self._push_deadline(arrival + self.request_timeout_s, request_id)
            return verdict
        try:
            verdict = await self.call(add)
            if verdict is not None:        # a core in its own process: its verdict comes after the engine thread
                await self._verdict(request_id, verdict)     # moved on (a burst's adds are not serialized)
        except asyncio.CancelledError:     # the client left while the request was being added
            self.abort(request_id)
            raise
        return rs

    async def _verdict(self, request_id: str, verdict) -> None:
        try:
            await asyncio.wrap_future(verdict)
        except asyncio.CancelledError:
            raise
        except BaseException:              # refused (ParamError, QueueFullError) or the core died: no state kept
            self._call(lambda: self.engine.states.pop(request_id, None))
            raise

    def abort(self, request_id: str) -> None:
        self._call(lambda: self._deliver([self.engine.end(request_id, RequestStatus.FINISHED_ABORTED)]))

    def fail_all(self, kind: str, message: str) -> None:
        """End every request in flight with an error (used at the end of a graceful shutdown)."""
        def fail():
            err = RequestFailure(kind, message)
            self._deliver([self.engine.end(rid, RequestStatus.FINISHED_ERROR, err) for rid in list(self.engine.states)])
        self._call(fail)

    def num_unfinished(self) -> int:
        return len(self.engine.states)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self.engine.shutdown()

    async def call(self, fn: Callable[[], object]) -> object:
        """Run fn in the engine thread between two steps (a consistent view of its state); its result
        or exception comes back here (EngineDeadError if the engine dies first)."""
        c = _Call(fn, asyncio.get_running_loop().create_future())
        with self._lock:
            if self.dead is not None:
                raise self.dead
            self._inbox.put(c)
        self._wake.set()
        return await c.fut

    def _call(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self.dead is None:
                self._inbox.put(fn)
        self._wake.set()

    # ------------------------------------------------------------ the engine thread
    def run(self) -> None:
        """The step loop, until shutdown() or the engine dies (then every client has its error)."""
        try:
            while not self._stop:
                self._run_inbox()
                self._expire()
                if not self.engine.has_unfinished_requests():
                    self.engine.check_alive()       # a core in its own process can die while nothing runs
                    if self.engine.warm_idle():     # GEMM shapes left from the load, a slice at a time
                        continue
                    self._wake.wait(timeout=self._idle_wait_s())
                    self._wake.clear()
                    continue
                taken = self.engine.steps_taken
                outs = self.engine.step_states()
                if self.engine.steps_taken == taken:    # (a core in its own process: no step came in the wait)
                    continue
                if self.on_stepped is not None:
                    self.on_stepped(self.engine)
                self._deliver(outs)
        except BaseException as e:      # nothing may leave a client waiting on a dead thread
            self._die(e)

    def _run_inbox(self) -> None:
        """The calls queued when this pass began, no more: a reader that queues its next call as soon as
        one is answered (a dashboard polling, each call a round trip to a core in its own process) must
        not keep the engine thread here while the steps wait."""
        for _ in range(self._inbox.qsize()):
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            item()

    def _push_deadline(self, deadline: float, request_id: str) -> None:
        """A finished request's deadline stays in the heap until it passes (expiring it is a no-op);
        when stale entries outnumber live ones the heap is rebuilt from the live ones, so it holds at
        most 2 x (requests in flight) + DEADLINES_SLACK entries rather than every request of the
        last --request-timeout seconds."""
        heapq.heappush(self._deadlines, (deadline, request_id))
        if len(self._deadlines) > 2 * len(self.engine.states) + DEADLINES_SLACK:
            self._deadlines = [d for d in self._deadlines if d[1] in self.engine.states]
            heapq.heapify(self._deadlines)

    def held(self) -> dict[str, int]:
        """Per-request entries: the engine's, plus this frontend's deadline heap."""
        return {**self.engine.held(), "async.deadlines": len(self._deadlines)}

    def _expire(self) -> None:
        now = time.monotonic()
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            expired.append(heapq.heappop(self._deadlines)[1])
        if expired:
            err = RequestFailure("timeout", f"the request did not finish within --request-timeout "
                                            f"({self.request_timeout_s:g} s)")
            self._deliver([self.engine.end(rid, RequestStatus.FINISHED_ERROR, err) for rid in expired])

    def _idle_wait_s(self) -> float:
        if not self._deadlines:
            return 0.5
        return min(0.5, max(0.0, self._deadlines[0][0] - time.monotonic()))

    def _deliver(self, delivered: list[Delivery | None]) -> None:
        delivered = [d for d in delivered if d is not None]
        if self.on_step is not None:
            try:
                self.on_step(self.engine, [out for _, out in delivered])
            except Exception:
                log.exception("on_step callback failed (metrics); serving goes on")
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for st, out in delivered:
            if st.sink is not None:
                by_loop.setdefault(st.sink.loop, []).append((st.sink, out))
        for loop, items in by_loop.items():          # one hand-off per step (per event loop: the server has one)
            try:
                loop.call_soon_threadsafe(_push_all, items)
            except RuntimeError:                     # that event loop is closed: nobody reads these streams
                for stream, out in items:
                    if not out.finished:
                        self.engine.abort(out.request_id)

    def _die(self, e: BaseException) -> None:
        err = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine thread died: {type(e).__name__}: {e}")
        log.critical("engine is dead: %s", err, exc_info=e)
        with self._lock:
            self.dead = err
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Call):
                item.resolve(err)
        for st in list(self.engine.states.values()):
            if st.sink is not None:
                st.sink.put(err)
        if self.on_dead is not None:
            self.on_dead(err)
