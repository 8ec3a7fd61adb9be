"""How the layers' keys and values share the block pool (plain Python: the cache manager and the
runner both read it).

Every layer of a Llama attends to the whole context, so one block table serves them all and a block
id names one block_size-token slice of every layer. A model whose layers differ in attention window
(Gemma 2 and 3, Qwen2/3 with max_window_layers) needs a table per kind of layer: a sliding layer's
keys behind its window are dead while the full layers' are not. After vLLM v1's hybrid allocator,
the layers of each window are cut into groups of one size G (the smallest window's layer count), and
a block id names a G-layer slice: the pool holds G layer planes, group g's j-th layer lives in plane j
of the blocks in g's table. Every group takes its blocks from the one pool; a sliding group gives
back the blocks behind its window while the request runs. The last group of a window may have fewer
than G layers (its other planes go unused): e.g. Gemma-3-4B's 5 full and 29 sliding layers make one
full group and six sliding ones of 5 planes (one plane of the last unused)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVLayout:
    windows: tuple[int, ...]           # per group: 0 full attention, W the last W positions
    layer_group: tuple[int, ...]       # per layer: its group
    layer_plane: tuple[int, ...]       # per layer: its plane of the pool
    planes: int                        # layer planes a block id spans (G)

    @classmethod
    def of(cls, layer_windows: Sequence[int]) -> KVLayout:
        n = len(layer_windows)
        kinds = sorted(set(layer_windows))
        if len(kinds) == 1:                     # one table serves every layer (the Llama case)
            return cls((kinds[0],), (0,) * n, tuple(range(n)), n)
        size = min(layer_windows.count(w) for w in kinds)
        windows, group, plane = [], [0] * n, [0] * n
        for w in kinds:
            for j, i in enumerate(i for i in range(n) if layer_windows[i] == w):
                if j % size == 0:
                    windows.append(w)
                group[i], plane[i] = len(windows) - 1, j % size
        return cls(tuple(windows), tuple(group), tuple(plane), size)

    @classmethod
    def uniform(cls, num_layers: int, window: int = 0) -> KVLayout:
        return cls.of([window] * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    def describe(self) -> str:
        """e.g. '1 full group, 6 window-1024 groups of 5 layer planes'."""
        counts: dict[int, int] = {}
        for w in self.windows:
            counts[w] = counts.get(w, 0) + 1
        parts = [f"{c} {'full' if w == 0 else f'window-{w}'} group{'s' if c > 1 else ''}" for w, c in counts.items()]
        return f"{', '.join(parts)} of {self.planes} layer plane{'s' if self.planes > 1 else ''}"


__all__ = ["KVLayout"]
