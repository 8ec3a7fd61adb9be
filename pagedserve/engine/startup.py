"""The start-up record: every phase of building an engine timed, with the process's RSS after it.

One owner: the engine's StartupTimer (EngineCore fills it; `engine.startup`). Phases are flat and
back to back: a phase's seconds run from the end of the one before it to its own end, so they add up
to the whole start-up and nothing between two phases goes unaccounted. Code below the engine (the
loader, the tokenizer) marks its phases through `phase(name)`, which times into the active timer and
does nothing when none is (a model loaded outside an engine). `current` names the phase under way:
what `serve` answers on /health while it loads."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field


def rss_mb() -> float:
    """This process's resident set now, in MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def process_age_s() -> float | None:
    """Seconds since this process started (the interpreter's own start-up included); None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass(slots=True, frozen=True)
class Phase:
    name: str
    seconds: float
    rss_mb: float          # the process's RSS after it


@dataclass
class StartupTimer:
    phases: list[Phase] = field(default_factory=list)
    current: str = "starting"            # the phase under way (what /health names while loading)
    ready: bool = False
    after_ready: dict[str, float] = field(default_factory=dict)   # work left for after ready (seconds, when done)
    pending: list[str] = field(default_factory=list)              # work left for after ready, not done yet
    # the engine core's own phases when it loads in a process of its own (serve's default): they ran beside
    # this process's, so they are shown apart and not added to total_s (this side's wait for it is a phase)
    beside: list[Phase] = field(default_factory=list)
    _last: float = field(default_factory=time.perf_counter)

    def add(self, name: str, seconds: float) -> None:
        """A phase measured elsewhere (the interpreter's start, before any timer existed)."""
        self.phases.append(Phase(name, max(0.0, seconds), rss_mb()))

    def mark(self, name: str) -> float:
        """End the phase `name` now: its seconds run from the previous mark."""
        now = time.perf_counter()
        secs, self._last = max(0.0, now - self._last), now
        self.phases.append(Phase(name, secs, rss_mb()))
        return secs

    @contextlib.contextmanager
    def phase(self, name: str):
        before, self.current = self.current, name
        try:
            yield self
        finally:
            self.mark(name)
            self.current = before

    def done(self) -> None:
        self.ready, self.current = True, "ready"

    @property
    def total_s(self) -> float:
        return sum(p.seconds for p in self.phases)

    def seconds(self) -> dict[str, float]:
        """Seconds by phase name (a name met twice: summed)."""
        out: dict[str, float] = {}
        for p in self.phases:
            out[p.name] = out.get(p.name, 0.0) + p.seconds
        return out

    def as_dict(self) -> dict:
        return {"ready": self.ready, "current": self.current, "total_s": round(self.total_s, 4),
                "rss_mb": round(self.phases[-1].rss_mb if self.phases else rss_mb(), 1),
                "phases": [{"phase": p.name, "seconds": round(p.seconds, 4), "rss_mb": round(p.rss_mb, 1)}
                           for p in self.phases],
                "after_ready": {name: round(secs, 4) for name, secs in self.after_ready.items()},
                "pending": list(self.pending),
                "core_process_phases": [{"phase": p.name, "seconds": round(p.seconds, 4), "rss_mb": round(p.rss_mb, 1)}
                                        for p in self.beside]}

    def summary(self, memory: dict[str, float] | None = None) -> str:
        """One line: 'ready in 2.9 s: imports 0.8, model read 1.1, ... | RSS 850 MB: weights 340, ...'."""
        parts = ", ".join(f"{n} {s:.2f}" for n, s in self.seconds().items())
        line = f"ready in {self.total_s:.2f} s: {parts} | RSS {rss_mb():.0f} MB"
        if memory:
            line += ": " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items())
        if self.beside:
            core = ", ".join(f"{p.name} {p.seconds:.2f}" for p in self.beside)
            line += f" | the engine core's process, beside: {core}, RSS {self.beside[-1].rss_mb:.0f} MB"
        return line


_ACTIVE: StartupTimer | None = None


@contextlib.contextmanager
def activate(timer: StartupTimer):
    """Make `timer` the one `phase` times into while an engine is built."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, timer
    try:
        yield timer
    finally:
        _ACTIVE = before


def active() -> StartupTimer | None:
    return _ACTIVE


def phase(name: str):
    """Time a phase into the active timer; nothing when there is none."""
    return _ACTIVE.phase(name) if _ACTIVE is not None else contextlib.nullcontext()


def mark(name: str) -> None:
    """End the phase `name` in the active timer now (nothing when there is none)."""
    if _ACTIVE is not None:
        _ACTIVE.mark(name)


class Background:
    """fn(*args) on a daemon thread from now; result() waits for it and returns it or raises its error.
    The tokenizer loads this way beside the model (tokenizer.json read by tokenizers and the chat template
    compiled: ~0.4 s, much of it while the model load's torch calls hold no GIL). A daemon thread: a model load that fails
    first does not wait for it to exit."""

    def __init__(self, fn, *args):
        self._value, self._error, self.seconds = None, None, 0.0
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="pagedserve-startup", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        t0 = time.perf_counter()
        try:
            self._value = fn(*args)
        except BaseException as e:       # handed to result()'s caller
            self._error = e
        self.seconds = time.perf_counter() - t0

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
