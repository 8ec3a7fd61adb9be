"""The tensor-parallel group: this rank's place in it and the collectives the model needs.

Built on torch.distributed's process groups (gloo on CPU, NCCL on CUDA), created from a TCPStore
rendezvous rather than `init_process_group`, so nothing global is set: an engine owns its group
and several engines can live in one process, one after another or side by side.

Two groups share the rendezvous: `compute` for the model's all-reduces and the logits gather (a
timeout, so a hung rank fails the engine instead of hanging it) and `control` for the step
records rank 0 broadcasts (no practical timeout: an idle server sends no steps for hours).
Ranks on one host (the `mp` backend on CPU) all-reduce through shared memory instead of gloo
(pagedserve.distributed.shm: ~0.6 ms per call over loopback gloo; PAGEDSERVE_TP_ALLREDUCE=gloo on
rank 0 keeps gloo, for comparison). A size-1 group does no communication at all.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.distributed.shm import ShmAllReduce

COMPUTE_TIMEOUT = timedelta(seconds=300)
CONTROL_TIMEOUT = timedelta(days=3650)


@dataclass(slots=True, frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0 hosts the TCPStore on host:port."""

    host: str
    port: int
    world_size: int


class TPGroup:
    """One rank's view of the tensor-parallel group."""

    def __init__(self, rank: int = 0, size: int = 1, compute=None, control=None, store=None):
        self.rank, self.size = rank, size
        self._compute, self._control = compute, control
        self._store = store             # kept alive: rank 0 serves the rendezvous from it
        self._shm: ShmAllReduce | None = None
        self._backend = "nccl" if compute is not None and type(compute).__name__.endswith("NCCL") else "gloo"

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    @classmethod
    def host_store(cls, world_size: int, host: str = "127.0.0.1", port: int = 0) -> tuple[Rendezvous, Any]:
        """Rank 0 starts the rendezvous store (port 0: any free port) before the other ranks exist."""
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=600),
                              wait_for_workers=False)
        return Rendezvous(host, store.port, world_size), store

    @classmethod
    def join(cls, rank: int, rdv: Rendezvous, device: str = "cpu", store=None, same_host: bool = False) -> TPGroup:
        """Connect this rank (blocks until every rank has joined). Rank 0 passes the store it hosts.
        same_host: every rank is on this machine (all-reduce through shared memory on CPU)."""
        if store is None:
            store = dist.TCPStore(rdv.host, rdv.port, rdv.world_size, is_master=False,
                                  timeout=timedelta(seconds=600))
        group = cls._connect(rank, rdv.world_size, store, device)
        if same_host and device == "cpu":
            group._map_shared_memory()
        return group

    def _map_shared_memory(self) -> None:
        """Rank 0 creates the mapping (or says "gloo"), every rank maps it, then its name is removed."""
        if self.is_driver:
            path = "" if os.environ.get("PAGEDSERVE_TP_ALLREDUCE") == "gloo" else ShmAllReduce.new_path()
            self._store.set("shm/path", path)
        else:
            path = self._store.get("shm/path").decode()
        if path:
            try:
                self._shm = ShmAllReduce(path, self.rank, self.size, create=self.is_driver)
            finally:
                self._control.allreduce([torch.zeros(1)]).wait()     # everyone has mapped it (or failed)
                if self.is_driver:
                    ShmAllReduce.unlink_path(path)

    def set_peer_check(self, gone) -> None:
        """Rank 0: how a shared-memory wait learns that a worker died (gloo sees the socket close)."""
        if self._shm is not None:
            self._shm.check_peers = gone

    @property
    def allreduce_kind(self) -> str:
        return "one rank" if self.size == 1 else ("shared memory" if self._shm is not None else self._backend)

    @classmethod
    def join_env(cls, device: str = "cpu") -> TPGroup:
        """env:// rendezvous, as torchrun sets it up (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
        store, rank, size = next(dist.rendezvous("env://", timeout=timedelta(seconds=600)))
        return cls._connect(rank, size, store, device)

    @classmethod
    def _connect(cls, rank: int, size: int, store, device: str) -> TPGroup:
        make = _nccl if device.startswith("cuda") else _gloo
        compute = make(dist.PrefixStore("compute", store), rank, size, COMPUTE_TIMEOUT)
        control = _gloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
        return cls(rank, size, compute, control, store)

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples, answers the user."""
        return self.rank == 0

    # ------------------------------------------------------------ model collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (bf16/fp16 partial sums are added in float32)."""
        if self.size == 1:
            return x
        if self._shm is not None and self._shm.fits(x):
            return self._shm.all_reduce(x)
        if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            y = x.float()
            self._compute.allreduce([y]).wait()
            return x.copy_(y)
        self._compute.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's (rows, cols) slice joined along the columns on rank 0 (None on the others)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        outs = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._compute.gather([outs] if self.is_driver else [], [x], opts).wait()
        return torch.cat(outs, dim=-1) if self.is_driver else None

    # ------------------------------------------------------------ control
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's obj, pickled, to every rank (the others pass nothing and get it back)."""
        if self.size == 1:
            return obj
        if self.is_driver:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            n = torch.tensor([data.numel()], dtype=torch.long)
        else:
            n = torch.zeros(1, dtype=torch.long)
        self._control.broadcast([n], dist.BroadcastOptions()).wait()
        if not self.is_driver:
            data = torch.empty(int(n), dtype=torch.uint8)
        self._control.broadcast([data], dist.BroadcastOptions()).wait()
        return obj if self.is_driver else pickle.loads(data.numpy().tobytes())

    # ------------------------------------------------------------ errors, through the rendezvous store
    def report_error(self, text: str) -> None:
        try:
            self._store.set(f"error/{self.rank}", text)
        except Exception:   # the store went with rank 0: nobody is left to tell
            pass

    def reported_errors(self) -> list[str]:
        """What failed ranks wrote (rank 0 reads this to say why the group broke)."""
        out = []
        for r in range(1, self.size):
            try:
                if self._store.check([f"error/{r}"]):
                    out.append(self._store.get(f"error/{r}").decode(errors="replace"))
            except Exception:
                break
        return out

    def close(self) -> None:
        for pg in (self._compute, self._control):
            if pg is not None and hasattr(pg, "shutdown"):
                try:
                    pg.shutdown()
                except Exception:   # already broken: nothing left to close
                    pass
        self._compute = self._control = self._store = self._shm = None


def _gloo(store, rank: int, size: int, timeout: timedelta):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nccl(store, rank: int, size: int, timeout: timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)
