"""Traffic classes (--traffic-classes): named bands of priority, each with its own latency targets,
admission limits and preemption mode. Plain Python: parsed once at start-up, read by the scheduler.

A request belongs to exactly one class: the one it names (`traffic_class` in the body or the
`X-Traffic-Class` header), else the band its `priority` falls in (the class with the highest
priority value not above the request's; below every class: the first). Classes are kept sorted by
priority, so a class's index is its rank: 0 is served first. Without the flag there is one implicit
class and the scheduler behaves exactly as before."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pagedserve.errors import ParamError

CLASS_KEYS = ("name", "priority", "ttft_p99_ms", "itl_p99_ms", "max_running", "max_budget_share", "max_waiting",
              "preemption_mode")
PREEMPTION_MODES = ("recompute", "swap")
# the step time aimed at: this fraction of the tightest target, for the time outside the step
# (detokenization, the HTTP thread) and the model's own error
ITL_HEADROOM = 0.8
# the least share step_headroom gives: a fit on few samples (the start-up probe's 24) can have a step it
# predicts near 0 s, whose ratio would otherwise plan every step at a hundredth of the target
MIN_HEADROOM = 0.25
# a TTFT target bounds every step to this share of it (an arrival waits for the step in flight, then
# needs a step of its own), whether or not its class has requests running
TTFT_STEP_SHARE = 0.5
# prefill tokens a step's first prefill chunk may always take while a time target caps prefill (prompts never
# stall); a later chunk takes only what fits
MIN_PREFILL_CHUNK = 16

Row = tuple[int, int, int]           # (start, tokens, samples): a step's row as the step-time model reads it


@dataclass(slots=True, frozen=True)
class TrafficClass:
    name: str
    priority: int
    ttft_p99_ms: float | None = None     # bounds every step to TTFT_STEP_SHARE of it; SLO attainment reported
    itl_p99_ms: float | None = None      # bounds each step while this class has running decodes
    max_running: int | None = None       # sequences of this class running at once
    max_budget_share: float | None = None   # of max_num_batched_tokens, per step
    max_waiting: int | None = None       # beyond it this class's new requests get 503 (Retry-After)
    preemption_mode: str | None = None   # when this class is preempted; None: the engine's --preemption-mode


def least_step_rows(target_decodes: Iterable[int], other_decodes: Iterable[Iterable[int]],
                    prefill_starts: Iterable[int]) -> list[Row]:
    """The least step the scheduler's rules guarantee while a class with an ITL target decodes: every decode
    of the classes with an ITL target (never deferred; their contexts in `target_decodes`), one decode of each
    other class that has decodes running (one a step always runs, whichever waited longest: the deepest is
    counted; per class, its decodes' contexts in `other_decodes`) and, when any prompt has tokens left to
    compute (`prefill_starts`: where each would go on), one chunk of up to MIN_PREFILL_CHUNK tokens that
    samples (prompts never stall; the first in class order may be the deepest). A monotone step-time model
    predicts every step the rules may be forced to take at or under this one."""
    rows = [(c, 1, 1) for c in target_decodes]
    rows += [(max(cs), 1, 1) for cs in map(list, other_decodes) if cs]
    starts = list(prefill_starts)
    if starts:
        rows.append((max(starts), MIN_PREFILL_CHUNK, 1))
    return rows


def step_headroom(cost) -> float:
    """The share of a target a step is planned under: ITL_HEADROOM, less where the step-time model's steps
    run past their predictions by more (its `ratio_p99`, measured / predicted, when it keeps one): on a
    shared host a plan at 0.8 x the target let one step in five pass it (issue 54); never under MIN_HEADROOM."""
    ratio = getattr(cost, "ratio_p99", None)
    return ITL_HEADROOM if not ratio else max(MIN_HEADROOM, min(ITL_HEADROOM, 1.0 / ratio))


class StepHeadroom:
    """The share of a time target the scheduler plans a step under (one for steps an ITL target binds, while its
    class decodes; one for steps half a TTFT target binds), kept by feedback on the steps' measured times: a step
    past its target shrinks the share by MISS, a step within it grows it by MISS / 99, so about one such step in a
    hundred runs past the target (a quantile tracker; issue 54 item 3: the fixed share, step_headroom, left the ITL
    p99 1.1-1.2x over a target near the floor on one host and 0.8x under a larger one, its batch work given away).
    Starts at START, ITL_HEADROOM (a share too high comes down in a few misses; one too low climbs a step at a
    time), kept in [LO, HI]. The floor is still read with step_headroom (a property of the host and its model, not
    of the controller's state)."""

    LO, HI, MISS, START = MIN_HEADROOM, 0.95, 0.05, ITL_HEADROOM

    def __init__(self):
        self.value = self.START
        self.steps = self.misses = 0

    def observe(self, seconds: float, target_s: float) -> None:
        self.steps += 1
        if seconds > target_s:
            self.misses += 1
            self.value = max(self.LO, self.value * (1 - self.MISS))
        else:
            self.value = min(self.HI, self.value * (1 + self.MISS / 99))


class TtftShare(StepHeadroom):
    """The share of a TTFT target a step may take (at most TTFT_STEP_SHARE: an arrival waits for the step in
    flight, then needs one of its own), kept by feedback on the first tokens themselves: one past its class's
    TTFT target shrinks it by MISS (10 %), one within grows it by MISS / 99, so about one first token in a
    hundred is late. Steps held to half the target still left the TTFT p99 over it where steps run past their
    plan and a request's way in and out costs time too (issue 54 item 5, served: 3 first tokens of 15 over
    1 s, at 1.0-1.4 s)."""

    # one observation a request, not a step: fewer samples, bigger moves
    LO, HI, MISS, START = 0.1, TTFT_STEP_SHARE, 0.1, TTFT_STEP_SHARE


def itl_floor_s(cost: Callable[[list[Row]], float], rows: list[Row]) -> float:
    """The least ITL target the host can hold for such a step: its predicted time over the headroom (the
    scheduler plans each step under step_headroom(cost) x the target)."""
    return cost(rows) / step_headroom(cost)


def reference_floor_rows(num_other_classes: int, max_model_len: int) -> list[Row]:
    """The least step at start-up, before anything runs: one decode of the class (a short context) beside
    the least unit of every other class at the longest context it may reach (max_model_len): one decode each
    and one MIN_PREFILL_CHUNK-token chunk. What the host must carry, whatever the lower classes send."""
    deep = max(1, max_model_len - MIN_PREFILL_CHUNK)
    return least_step_rows([MIN_PREFILL_CHUNK], [[max_model_len - 1]] * num_other_classes,
                           [deep] if num_other_classes else [])


class TrafficClasses:
    """The parsed, validated list; `resolve` maps a request's fields to a class index."""

    def __init__(self, classes: list[TrafficClass]):
        self.classes = tuple(sorted(classes, key=lambda c: c.priority))
        self.by_name = {c.name: i for i, c in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.classes)

    def __getitem__(self, i: int) -> TrafficClass:
        return self.classes[i]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @property
    def itl_target_s(self) -> float | None:
        """The tightest ITL target of any class (seconds), or None."""
        ts = [c.itl_p99_ms for c in self.classes if c.itl_p99_ms is not None]
        return min(ts) / 1e3 if ts else None

    @property
    def has_time_targets(self) -> bool:
        """Some class has an ITL or TTFT target: the scheduler plans steps by the step-time model."""
        return any(c.itl_p99_ms is not None or c.ttft_p99_ms is not None for c in self.classes)

    def floor_warnings(self, floor_ms: float) -> list[str]:
        """One line per class whose itl_p99_ms is under the floor (ms), naming the class, the field and the floor."""
        return [f"traffic class {c.name!r}: itl_p99_ms {c.itl_p99_ms:g} is under this host's floor of "
                f"{floor_ms:.1f} ms (the least step carrying its decode beside the other classes' least work, "
                f"over the step headroom): its ITL p99 will sit near the floor, not at the target"
                for c in self.classes if c.itl_p99_ms is not None and c.itl_p99_ms < floor_ms]

    def resolve(self, priority: int = 0, name: str | None = None) -> int:
        """The class index of a request; ParamError names `traffic_class` for an unknown name."""
        if name is not None:
            if name not in self.by_name:
                raise ParamError("traffic_class", f"traffic_class: unknown class {name!r} (the classes: "
                                                  f"{', '.join(self.names)})")
            return self.by_name[name]
        i = 0
        for j, c in enumerate(self.classes):
            if c.priority <= priority:
                i = j
        return i

    def describe(self) -> list[dict]:
        return [{k: getattr(c, k) for k in CLASS_KEYS} for c in self.classes]

    @classmethod
    def parse(cls, value) -> TrafficClasses | None:
        """A list of objects, its JSON text, or a path to a JSON file; None stays None. ValueError
        names the class and key at fault."""
        if value is None or isinstance(value, TrafficClasses):
            return value
        if isinstance(value, str):
            text = value
            if not value.lstrip().startswith("[") and os.path.isfile(value):
                with open(value) as f:
                    text = f.read()
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"traffic_classes must be a JSON list of class objects or a path to a JSON file "
                                 f"holding one, got {value!r} ({e})") from None
        if not isinstance(value, list) or not value:
            raise ValueError(f"traffic_classes must be a non-empty JSON list of class objects, got {value!r}")
        out, names, prios = [], set(), set()
        for i, c in enumerate(value):
            where = f"traffic_classes[{i}]"
            if not isinstance(c, dict):
                raise ValueError(f"{where} must be an object with name and priority, got {c!r}")
            unknown = sorted(set(c) - set(CLASS_KEYS))
            if unknown:
                raise ValueError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(CLASS_KEYS)})")
            for key in ("name", "priority"):
                if key not in c:
                    raise ValueError(f"{where}.{key} is required")
            name = c["name"]
            if not isinstance(name, str) or not name or len(name) > 64 or not name.isprintable():
                raise ValueError(f"{where}.name must be a non-empty printable string of at most 64 characters, "
                                 f"got {name!r}")
            where = f"traffic_classes[{i}] ({name})"
            if name in names:
                raise ValueError(f"{where}.name: {name!r} is named twice")
            prio = c["priority"]
            if not isinstance(prio, int) or isinstance(prio, bool):
                raise ValueError(f"{where}.priority must be an integer, got {prio!r}")
            if prio in prios:
                raise ValueError(f"{where}.priority: {prio} is another class's priority (each class is a band)")
            names.add(name)
            prios.add(prio)
            kw = {}
            for key in ("ttft_p99_ms", "itl_p99_ms"):
                v = c.get(key)
                if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                    raise ValueError(f"{where}.{key} must be a positive number of milliseconds, got {v!r}")
                kw[key] = None if v is None else float(v)
            for key in ("max_running", "max_waiting"):
                v = c.get(key)
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0
                                      or (key == "max_running" and v < 1)):
                    raise ValueError(f"{where}.{key} must be a {'positive' if key == 'max_running' else 'non-negative'}"
                                     f" integer, got {v!r}")
                kw[key] = v
            share = c.get("max_budget_share")
            if share is not None and (not isinstance(share, (int, float)) or isinstance(share, bool)
                                      or not 0 < share <= 1):
                raise ValueError(f"{where}.max_budget_share must be a number in (0, 1], got {share!r}")
            kw["max_budget_share"] = None if share is None else float(share)
            mode = c.get("preemption_mode")
            if mode is not None and mode not in PREEMPTION_MODES:
                raise ValueError(f"{where}.preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
            out.append(TrafficClass(name, prio, preemption_mode=mode, **kw))
        total = sum(c.max_budget_share or 0.0 for c in out)
        if total > 1 + 1e-9:
            raise ValueError(f"traffic_classes: the max_budget_share values sum to {total:g}, over 1")
        return cls(out)
