"""Executors run each step's record on the model: in this process alone (tensor_parallel_size 1),
or on a tensor-parallel group whose rank 0 is this process and whose other ranks are
torch.multiprocessing children (`mp`), Ray actors (`ray`) or torchrun's processes
(`external_launcher`).

The engine's life with any of them:
    executor = make_executor(args, source, dtype)   # workers started, group joined
    model, cfg = load_model(..., executor.tp)        # this rank's slice
    runner = executor.init_runner(model, CacheSpec(...))  # every rank allocates the same blocks
    executor.execute(step) -> RunnerOutput           # rank 0 broadcasts the step, all run it
    executor.shutdown()                              # workers leave, processes are joined

A rank that dies or hangs breaks the group: the executor raises EngineDeadError naming it (the
other ranks' state is unknown), never a silent hang.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Callable

import torch

from pagedserve.config import EngineArgs
from pagedserve.distributed.group import TPGroup
from pagedserve.distributed.worker import CacheSpec, WorkerSpec, mp_worker_main, run_worker
from pagedserve.errors import EngineDeadError
from pagedserve.model.loader import ModelSource

log = logging.getLogger("pagedserve")


class Executor:
    """tensor_parallel_size 1: the runner in this process."""

    def __init__(self):
        self.tp = TPGroup.single()
        self.runner = None

    def init_runner(self, model, cache: CacheSpec):
        self.runner = cache.runner(model)
        return self.runner

    def execute(self, so):
        return self.runner.execute(so)

    def shutdown(self) -> None:
        pass


_HINT = ("\n  (no error reported: it may have failed before joining. A script that builds a tensor-parallel engine "
         "must do so under `if __name__ == \"__main__\":`, since spawned workers import the main module; its "
         "traceback is on stderr)")


class _Ranks:
    """The other ranks' handles: is any gone, stop them all. Kept apart from the executor so a
    finalizer can stop them without keeping the executor alive."""

    def gone(self) -> str | None:
        return None

    def stop(self, timeout_s: float) -> None:
        pass


class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel group: it drives, the other ranks follow the step records."""

    def __init__(self, ranks: _Ranks, join: Callable[[], TPGroup], threads: int | None):
        super().__init__()
        self._ranks = ranks
        self._threads_before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        self._finalizer = weakref.finalize(self, ranks.stop, 0.0)   # collected or at exit: no waiting
        self._dead: str | None = None
        self._closed = False
        try:
            self.tp = self._wait("join the tensor-parallel group", join)
        except BaseException:
            self.shutdown()
            raise
        self.tp.set_peer_check(ranks.gone)

    def _wait(self, what: str, fn: Callable):
        """fn() in a helper thread while watching the other ranks: a rank that dies first ends the wait."""
        box: dict = {}

        def call():
            try:
                box["value"] = fn()
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=call, name=f"tp-{what}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            gone = self._ranks.gone()
            if gone and t.is_alive():
                raise EngineDeadError(f"tensor parallelism: could not {what}: {gone}{self._reports() or _HINT}")
        if "error" in box:
            raise EngineDeadError(f"tensor parallelism: could not {what}: {box['error']}"
                                  f"{self._reports()}") from box["error"]
        return box.get("value")

    def _reports(self) -> str:
        errs = self.tp.reported_errors() if self.tp.size > 1 else []
        return "".join(f"\n  {e.strip()}" for e in errs)

    def init_runner(self, model, cache: CacheSpec):
        self._wait("send the memory plan", lambda: self.tp.broadcast_object(cache))
        runner = super().init_runner(model, cache)
        self._wait("start every rank's runner", lambda: self.tp.all_reduce(torch.zeros(1)))
        log.info("tensor parallel: %d ranks ready (all-reduce: %s)", self.tp.size, self.tp.allreduce_kind)
        return runner

    def execute(self, so):
        """Broadcast the step (without its sampling parameters), run it here too; sampling stays
        here, so a fault in it fails only this step's requests, as with one rank."""
        if self._dead:
            raise EngineDeadError(self._dead)
        try:
            self.tp.broadcast_object(so.for_workers())
        except Exception as e:             # a rank died or hung: the group is gone
            self._dead = (f"tensor parallelism: sending the step failed ({type(e).__name__}: {e})"
                          f"{self._why(wait_s=2.0)}")
            raise EngineDeadError(self._dead) from e
        try:
            return self.runner.execute(so)
        except EngineDeadError as e:       # the forward failed (here, or a collective: another rank)
            self._dead = f"{e}{self._why()}"
            raise EngineDeadError(self._dead) from e

    def _why(self, wait_s: float = 0.0) -> str:
        """Which rank is gone, and what the ranks reported. wait_s: a failed collective can see a killed
        rank's closed sockets before its exit is reaped; give it that long to be named."""
        deadline = time.monotonic() + wait_s
        while not (gone := self._ranks.gone()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return (f"; {gone}" if gone else "") + self._reports()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.tp.size > 1 and not self._dead and not self._ranks.gone():
            try:
                self.tp.broadcast_object(None)     # every worker leaves its loop
            except Exception:
                pass
        self._ranks.stop(0.0 if self._dead else 10.0)   # dead: they may sit in a collective
        self._finalizer.detach()
        self.tp.close()
        torch.set_num_threads(self._threads_before)


# ---------------------------------------------------------------- mp: torch.multiprocessing children

class _Processes(_Ranks):
    def __init__(self, procs: list):
        self.procs = procs

    def gone(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _mp_executor(args: EngineArgs, source: ModelSource, dtype: str) -> TPExecutor:
    n = args.tensor_parallel_size
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // n)
    rdv, store = TPGroup.host_store(n)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, n):
        spec = WorkerSpec(source, dtype, _device(args.device, rank), rank, rdv, threads, same_host=True)
        p = ctx.Process(target=mp_worker_main, args=(spec,), name=f"pagedserve-tp{rank}", daemon=True)
        p.start()
        procs.append(p)
    return TPExecutor(_Processes(procs), lambda: TPGroup.join(0, rdv, _device(args.device, 0), store, same_host=True),
                      threads)


# ---------------------------------------------------------------- ray: actors in a placement group

class _RayActors(_Ranks):
    def __init__(self, actors, refs, pg):
        self.actors, self.refs, self.pg = actors, refs, pg

    def gone(self) -> str | None:
        import ray
        done, _ = ray.wait(self.refs, num_returns=1, timeout=0)
        if not done:
            return None
        try:
            ray.get(done[0])
            return f"Ray worker rank {self.refs.index(done[0]) + 1} left"
        except Exception as e:
            return f"Ray worker rank {self.refs.index(done[0]) + 1} failed: {type(e).__name__}: {str(e)[:500]}"

    def stop(self, timeout_s: float) -> None:
        import ray
        if not ray.is_initialized():
            return
        ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        for a in self.actors:
            ray.kill(a)
        ray.util.remove_placement_group(self.pg)


class RayWorker:
    """A Ray actor holding one rank; run() is the worker's whole life."""

    def run(self, spec: WorkerSpec) -> None:
        run_worker(spec)


def _ray_executor(args: EngineArgs, source: ModelSource, dtype: str) -> TPExecutor:
    try:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as e:
        raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'pagedserve[ray]'") from e
    n = args.tensor_parallel_size
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True)      # an existing cluster (RAY_ADDRESS / `ray start`) or a local one
    gpu = args.device == "cuda"
    pg = ray.util.placement_group([{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}] * (n - 1), strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    host = ray.util.get_node_ip_address()
    rdv, store = TPGroup.host_store(n, host="0.0.0.0")
    rdv = type(rdv)(host, rdv.port, n)
    actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RayWorker)
    actors, refs = [], []
    for rank in range(1, n):
        a = actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank - 1)).remote()
        spec = WorkerSpec(source, dtype, "cuda:0" if gpu else "cpu", rank, rdv, args.num_threads)
        actors.append(a)
        refs.append(a.run.remote(spec))
    return TPExecutor(_RayActors(actors, refs, pg), lambda: TPGroup.join(0, rdv, _device(args.device, 0), store),
                      args.num_threads)


# ---------------------------------------------------------------- external_launcher: torchrun's processes

def _external_executor(args: EngineArgs) -> TPExecutor:
    rank, world = int(os.environ.get("RANK", "-1")), int(os.environ.get("WORLD_SIZE", "-1"))
    if rank != 0 or world != args.tensor_parallel_size:
        raise ValueError(f"distributed_executor_backend 'external_launcher' runs under torchrun with WORLD_SIZE = "
                         f"tensor_parallel_size ({args.tensor_parallel_size}) and the engine on RANK 0; got RANK "
                         f"{rank}, WORLD_SIZE {world} (other ranks run pagedserve.distributed.run_worker_from_env)")
    return TPExecutor(_Ranks(), lambda: TPGroup.join_env(_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))),
                      args.num_threads)


def run_worker_from_env(args: EngineArgs) -> None:
    """What a torchrun rank other than 0 runs: the worker loop, until rank 0's engine shuts down."""
    from pagedserve.host import auto_dtype
    from pagedserve.model.loader import resolve_model
    dtype = auto_dtype(args.device)[0] if args.dtype == "auto" else args.dtype
    local = int(os.environ.get("LOCAL_RANK", 0))
    run_worker(WorkerSpec(resolve_model(args.model, args.revision), dtype, _device(args.device, local), int(os.environ["RANK"]),
                          None, args.num_threads))


def is_external_worker(args: EngineArgs) -> bool:
    return args.distributed_executor_backend == "external_launcher" and int(os.environ.get("RANK", "0")) > 0


# ----------------------------------------------------------------

def make_executor(args: EngineArgs, source: ModelSource, dtype: str) -> Executor:
    if args.tensor_parallel_size == 1:
        return Executor()
    backend = args.distributed_executor_backend
    if backend == "ray":
        return _ray_executor(args, source, dtype)
    if backend == "external_launcher":
        return _external_executor(args)
    return _mp_executor(args, source, dtype)


def _device(device: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if device == "cuda" else device
