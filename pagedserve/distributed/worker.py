"""A tensor-parallel rank other than 0: it joins the group, loads its slice of the model, builds its
ModelRunner (its KV heads, the same block count), then runs every step record rank 0 broadcasts
until rank 0 sends None. It never schedules or samples; rank 0 does both.

The same function runs in a torch.multiprocessing child (`mp`), a Ray actor (`ray`) or a
process started by torchrun (`external_launcher`)."""
from __future__ import annotations

import ctypes
import logging
import signal
import traceback
from dataclasses import dataclass

import torch

from pagedserve.core.kv_layout import KVLayout
from pagedserve.distributed.group import Rendezvous, TPGroup
from pagedserve.host import fix_malloc_thresholds
from pagedserve.model.loader import ModelSource, load_model
from pagedserve.runner.model_runner import ModelRunner

log = logging.getLogger("pagedserve")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """What a rank needs to start: which model, how, and where the group meets."""

    source: ModelSource
    dtype: str                      # float32 | bfloat16 | float16 (already resolved from auto)
    device: str                     # cpu | cuda:<local rank>
    rank: int
    rendezvous: Rendezvous | None   # None: env:// (torchrun sets MASTER_ADDR/PORT, RANK, WORLD_SIZE)
    num_threads: int | None = None
    same_host: bool = False         # every rank on this machine (mp): all-reduce through shared memory


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """Rank 0's memory plan, broadcast once: every rank allocates the same block ids."""

    num_blocks: int
    block_size: int
    num_host_blocks: int
    kv_dtype: torch.dtype
    seed: int
    layout: KVLayout | None = None        # how layers share block tables; None: the model's own (cfg.kv_layout)
    attention_backend: str = "auto"       # EngineArgs.attention_backend
    decode_graphs: tuple[int, int] | None = None    # (max_num_seqs, max_model_len): CUDA graphs; None: eager
    rows_as_decode: bool = False          # --batch-invariant: a prompt's tokens are decode rows too

    def runner(self, model) -> ModelRunner:
        """This rank's runner: the planned blocks for its own KV heads."""
        return ModelRunner(model, self.num_blocks, self.block_size, self.num_host_blocks, self.seed, self.kv_dtype,
                           self.layout, self.attention_backend, self.decode_graphs, self.rows_as_decode)


def run_worker(spec: WorkerSpec) -> None:
    """The worker's whole life. A failure is written to the rendezvous store for rank 0 to report."""
    fix_malloc_thresholds()
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(spec.device)       # NCCL's communicator binds to the current device
    group = join_group(spec)
    try:
        model, _ = load_model(spec.source, DTYPES[spec.dtype], spec.device, "none", group)
        cache: CacheSpec | None = group.broadcast_object()
        if cache is None:                                       # rank 0 failed to start: leave quietly
            return
        runner = cache.runner(model)
        group.all_reduce(torch.zeros(1))                       # ready
        while (so := group.broadcast_object()) is not None:
            runner.execute(so)
    except Exception as e:
        group.report_error(f"rank {spec.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    finally:
        group.close()


def join_group(spec: WorkerSpec) -> TPGroup:
    if spec.rendezvous is None:
        return TPGroup.join_env(spec.device)
    return TPGroup.join(spec.rank, spec.rendezvous, spec.device, same_host=spec.same_host)


def mp_worker_main(spec: WorkerSpec) -> None:
    """Entry of a torch.multiprocessing child: it dies with its parent (no orphans even when the
    parent is killed), and a SIGTERM ends it at once."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp-rank {spec.rank} %(levelname)s %(message)s")
    run_worker(spec)
