"""LoRA adapters as requests name them (vLLM's LoRARequest), and the engine's registry of them.

The registry is plain Python (no tensors): adapter name -> (id, path). Ids are the engine's own and
never reused, so the prefix cache (keyed by id) can never give one adapter's KV to another, even
after an adapter is unloaded and a different one loaded under the same name. The weights live in
the model runner (model/lora.py)."""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from pagedserve.errors import ParamError


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
    """Adapter name -> LoRAEntry, at most `capacity` (max_cpu_loras: each holds its weights in memory)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.by_name: dict[str, LoRAEntry] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.by_name)

    def get(self, name: str) -> LoRAEntry | None:
        return self.by_name.get(name)

    def check_room(self, name: str) -> None:
        if name in self.by_name:
            raise ParamError("lora_name", f"lora_name: an adapter named {name!r} is already loaded")
        if len(self.by_name) >= self.capacity:
            raise ParamError("lora_name", f"lora_name: {len(self.by_name)} adapters are loaded, the most max_cpu_loras "
                             f"({self.capacity}) allows; unload one first")

    def add(self, name: str, path: str, rank: int) -> LoRAEntry:
        self.check_room(name)
        entry = self.by_name[name] = LoRAEntry(next(self._ids), path, rank)
        return entry

    def remove(self, name: str) -> LoRAEntry | None:
        return self.by_name.pop(name, None)
