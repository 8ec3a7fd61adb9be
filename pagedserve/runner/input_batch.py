"""The runner's persistent input batch: a row per sequence the scheduler has running, kept from step
to step and changed only by each step's record (core/step.py): a sequence's first record makes its row
(its TableDelta starts at 0), later ones rewrite only the changed tail of its block tables, and the
record's `preempted` and `finished_req_ids` remove rows. A step's inputs are then gathered from these
arrays (ModelRunner.prepare) instead of rebuilt from whole tables sent each step.

Rows stay dense: a removed row's place takes the last row (one row copy). Each group of layers
(core/kv_layout.py) has its own (rows, width) int64 table, zero (the null block) past a row's end,
grown by doubling."""
from __future__ import annotations

import numpy as np

from pagedserve.core.kv_cache_manager import TableDelta
from pagedserve.core.step import SchedulerOutput


class InputBatch:
    def __init__(self, num_groups: int, rows: int = 16, width: int = 16):
        self.row_of: dict[str, int] = {}          # request id -> its row
        self.req_ids: list[str] = []              # row -> request id
        self.tables = [np.zeros((rows, width), dtype=np.int64) for _ in range(num_groups)]
        self.num_blocks = [np.zeros(rows, dtype=np.int64) for _ in range(num_groups)]   # each row's table length

    def __len__(self) -> int:
        return len(self.req_ids)

    def update(self, so: SchedulerOutput) -> None:
        """Apply one step's record: drop the rows of sequences that ended or were preempted, then each
        scheduled sequence's table changes (a preempted sequence admitted again in the same step comes
        back whole: its delta starts at 0)."""
        for rid in so.finished_req_ids:
            self.remove(rid)
        for rid in so.preempted:
            self.remove(rid)
        for s in so.seqs:
            if s.tables:
                self.apply(s.request_id, s.tables)

    def apply(self, rid: str, tables: tuple[TableDelta, ...]) -> None:
        row = self.row_of.get(rid)
        if row is None:
            if any(d.start for d in tables):
                raise ValueError(f"block table change for {rid!r} from entry {tables[0].start}, "
                                 "and the runner holds no table for it")
            row = self._add(rid)
        for g, d in enumerate(tables):
            t, n = self.tables[g], self.num_blocks[g]
            end = d.num_blocks
            if end > t.shape[1]:
                t = self.tables[g] = _grown(t, t.shape[0], max(end, 2 * t.shape[1]))
            if d.block_ids:
                t[row, d.start:end] = d.block_ids
            if n[row] > end:
                t[row, end:n[row]] = 0            # cut: the entries past the end are the null block again
            n[row] = end

    def _add(self, rid: str) -> int:
        row = len(self.req_ids)
        if row == self.tables[0].shape[0]:
            for g, t in enumerate(self.tables):
                self.tables[g] = _grown(t, 2 * row, t.shape[1])
                self.num_blocks[g] = np.concatenate([self.num_blocks[g], np.zeros(row, dtype=np.int64)])
        self.row_of[rid] = row
        self.req_ids.append(rid)
        return row

    def remove(self, rid: str) -> None:
        row = self.row_of.pop(rid, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        moved = self.req_ids.pop()
        for t, n in zip(self.tables, self.num_blocks):
            if row != last:
                t[row] = t[last]
                n[row] = n[last]
            t[last, :n[last]] = 0
            n[last] = 0
        if row != last:
            self.req_ids[row] = moved
            self.row_of[moved] = row

    def table(self, rid: str, group: int = 0) -> tuple[int, ...]:
        """One sequence's block table as held (for tests and the draft model's profile)."""
        row = self.row_of[rid]
        return tuple(self.tables[group][row, :self.num_blocks[group][row]].tolist())


def _grown(t: np.ndarray, rows: int, width: int) -> np.ndarray:
    out = np.zeros((rows, width), dtype=t.dtype)
    out[:t.shape[0], :t.shape[1]] = t
    return out
