"""LoRA adapters as requests name them (vLLM's LoRARequest), and the engine's registry of them.

The registry is plain Python (no tensors): adapter name -> (id, path). Ids are the engine's own and
never reused, so the prefix cache (keyed by id) can never give one adapter's KV to another, even
after an adapter is unloaded and a different one loaded under the same name. The weights live in
the model runner (model/lora.py)."""
from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.errors import ParamError

log = logging.getLogger("pagedserve")


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """vLLM's: `LLM.generate(..., lora_request=LoRARequest("sql", 1, "/path/to/adapter"))`. The name
    identifies the adapter (lora_int_id is accepted for vLLM's signature; ids are assigned here)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def parse_lora_modules(value) -> dict[str, str]:
    """--lora-modules as vLLM takes it: NAME=PATH items or JSON objects {"name": ..., "path": ...}
    (a list of them, or one string of space-separated items); a dict name -> path passes as is.
    ValueError names lora_modules."""
    if value is None:
        return {}
    if isinstance(value, dict):
        items = [{"name": k, "path": v} for k, v in value.items()]
    else:
        items = value.split() if isinstance(value, str) else list(value)
    out: dict[str, str] = {}
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora_modules: {item!r} is not valid JSON ({e})") from None
        if isinstance(item, dict):
            name, path = item.get("name"), item.get("path")
        elif isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        else:
            raise ValueError(f"lora_modules: {item!r} must be NAME=PATH or {{\"name\": ..., \"path\": ...}}")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: {item!r} needs a non-empty name and path")
        if name in out:
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        out[name] = path
    return out


@dataclass(slots=True)
class LoRAEntry:
    lora_id: int
    path: str
    rank: int


class LoRARegistry:
    """The engine's adapters (enable_lora): name -> LoRAEntry, at most `capacity` (max_cpu_loras: each
    holds its weights in memory), their weights loaded into and dropped from `runner`. An unloaded
    adapter is retired: requests in flight (`live()`: the adapter ids they use) finish with it, and
    its weights go when the last of them ends (`drop_retired`, after every step). Engine thread only, but
    for `names`: the loaded names as one frozenset, replaced whole on every load and unload, so another
    thread (the server's, checking a request's `model`) reads a consistent set without a lock."""

    def __init__(self, args, runner, model_config, live: Callable[[], set[int]]):
        modules = parse_lora_modules(args.lora_modules)
        self.capacity = args.max_cpu_loras or max(args.max_loras, len(modules)) + 8
        self.by_name: dict[str, LoRAEntry] = {}
        self.names: frozenset[str] = frozenset()
        self.retired: set[int] = set()
        self._ids = itertools.count(1)
        self._runner, self._config, self._max_rank, self._live = runner, model_config, args.max_lora_rank, live
        runner.enable_lora(args.max_loras, args.max_lora_rank)
        for name, path in modules.items():
            self.load(name, path, field="lora_modules")
        log.info("LoRA: up to %d adapters per step, rank <= %d, %d loaded (%s), at most %d in memory",
                 args.max_loras, args.max_lora_rank, len(modules), ", ".join(modules) or "none", self.capacity)

    def __len__(self) -> int:
        return len(self.by_name)

    def get(self, name: str) -> LoRAEntry | None:
        return self.by_name.get(name)

    def load(self, name: str, path: str, field: str = "lora_path") -> LoRAEntry:
        """Load a PEFT adapter folder under `name`; ValueError naming what is wrong (`field`: the path's
        parameter)."""
        from pagedserve.model.lora import read_adapter          # tensors: imported where adapters are loaded
        if name in self.by_name:
            raise ParamError("lora_name", f"lora_name: an adapter named {name!r} is already loaded")
        if len(self.by_name) >= self.capacity:
            raise ParamError("lora_name", f"lora_name: {len(self.by_name)} adapters are loaded, the most max_cpu_loras "
                             f"({self.capacity}) allows; unload one first")
        weights = read_adapter(path, self._config, self._max_rank, field)
        entry = self.by_name[name] = LoRAEntry(next(self._ids), path, weights.rank)
        self.names = frozenset(self.by_name)
        self._runner.add_lora(entry.lora_id, weights)
        log.info("LoRA adapter %r loaded from %s (rank %d, %.1f MiB)", name, path, weights.rank, weights.nbytes / 2**20)
        return entry

    def unload(self, name: str) -> bool:
        """New requests can no longer name it; those in flight finish with it. False: no adapter has that name."""
        entry = self.by_name.pop(name, None)
        if entry is None:
            return False
        self.names = frozenset(self.by_name)
        self.retired.add(entry.lora_id)
        self.drop_retired()
        log.info("LoRA adapter %r unloaded", name)
        return True

    def drop_retired(self) -> None:
        if self.retired:
            live = self._live()
            for lora_id in self.retired - live:
                self._runner.remove_lora(lora_id)
            self.retired &= live


def lora_id(loras: LoRARegistry | None, lora: LoRARequest | None) -> int:
    """The engine's id of a request's adapter (0: none), loading it when a LoRARequest names a new one."""
    if lora is None:
        return 0
    if not isinstance(lora, LoRARequest):
        raise ValueError("lora_request must be a LoRARequest")
    if loras is None:
        raise ParamError("lora_request", "lora_request: this engine runs without LoRA (enable_lora)")
    entry = loras.get(lora.lora_name)
    if entry is None:
        if not lora.lora_path:
            raise ParamError("lora_request", f"lora_request: no adapter named {lora.lora_name!r} is loaded")
        try:
            entry = loras.load(lora.lora_name, lora.lora_path)
        except ValueError as e:
            raise ParamError("lora_request", str(e)) from None
    elif lora.lora_path and lora.lora_path != entry.path:
        raise ParamError("lora_request", f"lora_request: the adapter {lora.lora_name!r} is loaded from "
                                         f"{entry.path!r}, not {lora.lora_path!r}")
    return entry.lora_id
