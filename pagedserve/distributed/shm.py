"""All-reduce through shared memory, for tensor-parallel ranks on one host (the `mp` backend on CPU).

Gloo over loopback TCP costs ~0.6 ms per all-reduce on the 2-core hosts we measure on, whatever the
size: the model does two per layer, 61 per step for the default model, which is more than the
step's compute. Ranks on one host can instead meet in one shared mapping (as vLLM's CPU backend
does): each rank copies its partial sum into its own slot, publishes a sequence number, waits for
every rank's number, and adds the slots in rank order. Every rank adds the same float32 values in
the same order, so every rank gets bit-identical results (ranks must never drift apart).

Two buffers alternate: a rank writes buffer s % 2 at sequence s only after it saw every rank
publish s - 1, so no rank can still be reading that buffer from s - 2. x86 keeps stores in order
(TSO): the slot is written before the sequence number that announces it.
"""
from __future__ import annotations

import os
import time
import uuid
from typing import Callable

import numpy as np
import torch

SLOT_FLOATS = 1 << 20          # 4 MiB per rank and buffer: 1024 tokens x 1024 hidden; larger tensors use gloo
_FLAG_STRIDE = 8               # int64s between two ranks' flags: one cache line each


class ShmAllReduce:
    def __init__(self, path: str, rank: int, size: int, create: bool):
        self.rank, self.size, self.path = rank, size, path
        header = size * _FLAG_STRIDE * 8
        nbytes = header + 2 * size * SLOT_FLOATS * 4
        if create:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._raw = raw
        self.flags = raw[:header].numpy().view(np.int64)[::_FLAG_STRIDE]     # (size,) sequence numbers
        self.slots = raw[header:].view(torch.float32).view(2, size, SLOT_FLOATS)
        self.seq = 0
        self.check_peers: Callable[[], str | None] | None = None      # rank 0: is a worker gone?
        self.timeout_s = 300.0

    @staticmethod
    def new_path() -> str:
        return os.path.join("/dev/shm", f"pagedserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() <= SLOT_FLOATS

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks into x (in place), in float32."""
        n = x.numel()
        self.seq += 1
        buf = self.slots[self.seq % 2, :, :n]
        buf[self.rank].copy_(x.reshape(-1))
        self.flags[self.rank] = self.seq
        self._wait(self.seq)
        acc = buf[0].clone()
        for r in range(1, self.size):
            acc += buf[r]
        x.copy_(acc.view(x.shape))
        return x

    def _wait(self, seq: int) -> None:
        flags = self.flags
        if flags.min() >= seq:
            return
        t0 = time.monotonic()
        spins = 0
        while flags.min() < seq:
            os.sched_yield()            # where ranks outnumber cores, let the one we wait for run
            spins += 1
            if spins % 4096 == 0:
                waited = time.monotonic() - t0
                gone = self.check_peers() if self.check_peers is not None else None
                if gone or waited > self.timeout_s:
                    raise RuntimeError(f"shared-memory all-reduce: {gone or f'no answer in {waited:.0f} s'}")

    @staticmethod
    def unlink_path(path: str) -> None:
        """Remove the file once every rank mapped it (the mappings stay valid): nothing is left in
        /dev/shm even if a rank is killed."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
