"""AsyncLLMEngine: the engine steps in its own thread; each request gets an asyncio stream.

HTTP handlers never block the step loop: they hand requests over a thread-safe queue and read
outputs from a per-request asyncio.Queue fed with loop.call_soon_threadsafe. Aborts are applied
between steps, so a disconnected client's blocks are freed at the next step."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

log = logging.getLogger("pagedserve")


@dataclass(slots=True)
class _Submit:
    request_id: str
    prompt: object
    params: SamplingParams
    priority: int
    arrival_time: float
    done: threading.Event
    error: BaseException | None = None


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue[_Submit] = queue.Queue()
        self._aborts: queue.Queue[str] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self.on_step = None          # callback(engine, outputs) run in the engine thread (metrics)
        self.on_finish = None        # callback(output) for finished requests
        self._thread = threading.Thread(target=self._loop, name="pagedserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ called from asyncio
    async def generate(self, request_id: str, prompt, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's output after every step that changed it; the last one is finished.
        Cancelling the iteration (client gone) aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        sub = _Submit(request_id, prompt, params, priority, time.monotonic(), threading.Event())
        self._inbox.put(sub)
        self._wake.set()
        await loop.run_in_executor(None, sub.done.wait)
        if sub.error is not None:
            self._streams.pop(request_id, None)
            raise sub.error
        finished = False
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain()
            if not eng.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except Exception:   # a bug must not hang every client: fail the in-flight requests, keep serving
                log.exception("engine step failed; aborting in-flight requests")
                outs = self._abort_all()
            if self.on_step is not None:
                self.on_step(eng, outs)
            for out in outs:
                s = self._streams.get(out.request_id)
                if s is not None:
                    s[0].call_soon_threadsafe(s[1].put_nowait, out)

    def _abort_all(self) -> list[RequestOutput]:
        outs = []
        for rid, st in list(self.engine.states.items()):
            self.engine.abort(rid)
            outs.append(self.engine._output(st))
        return outs

    def _drain(self) -> None:
        eng = self.engine
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                break
            eng.abort(rid)
        while True:
            try:
                sub = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                eng.add_request(sub.request_id, sub.prompt, sub.params, priority=sub.priority, stream=True,
                                arrival_time=sub.arrival_time)
            except BaseException as e:   # reported to the caller, never kills the loop
                sub.error = e
            sub.done.set()
