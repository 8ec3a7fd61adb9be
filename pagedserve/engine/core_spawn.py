"""Starting the engine core's process (engine/core_proc.py) with nothing but the standard library imported:
`pagedserve serve` spawns it right after binding its port, so the core's imports and model load run beside
the frontend's own imports (torch, FastAPI) instead of after them; LLMEngine spawns it when it makes its
client. `ProcClient` (engine/core_proc.py) takes the started process and waits for its Ready; this module never
imports that one (the child does: `_run`).

Also here: whether a model can run its core in its own process at all (`images_stay_in_process`)."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
from dataclasses import dataclass

from pagedserve.config import EngineArgs

log = logging.getLogger("pagedserve")


@dataclass
class SpawnedCore:
    """A started core process and this side's end of its pipe (ProcClient's until it shuts the core down)."""

    proc: multiprocessing.process.BaseProcess
    conn: object


def _run(args: EngineArgs, conn, warm_at_load: bool, log_level: int, setup) -> None:
    from pagedserve.engine.core_proc import core_main       # (the child's imports: torch, the model code)
    core_main(args, conn, warm_at_load, log_level, setup)


def spawn_core(args: EngineArgs, warm_at_load: bool = True, setup=None) -> SpawnedCore:
    """setup: a module-level function the core's process runs on the built core (a benchmark's fake device)."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe(duplex=True)
    # not a daemon: the core starts tensor-parallel workers of its own
    proc = ctx.Process(target=_run, name="pagedserve-core",
                       args=(args, child, warm_at_load, logging.getLogger("pagedserve").getEffectiveLevel(), setup))
    proc.start()
    child.close()                       # the child's end lives in the child only: its exit breaks the pipe
    return SpawnedCore(proc, conn)


def spawn_core_for(args: EngineArgs, warm_at_load: bool = True, setup=None) -> SpawnedCore | None:
    """The core's process for these args, started; None when the model's core must stay in the caller's process
    (images_stay_in_process), said once in the log. The one place serve and LLMEngine decide it."""
    if images_stay_in_process(args):
        log.info("engine process: a vision-language model's images do not cross the core's protocol; "
                 "its core runs in this process")
        return None
    return spawn_core(args, warm_at_load, setup)


def images_stay_in_process(args: EngineArgs) -> bool:
    """True for a vision-language model (an --mmproj beside a GGUF, or an HF folder whose config.json names a
    vision-language model type): its images are tensors the core's protocol does not carry, so its core runs in
    the frontend's process whatever engine_process says. The model resolved as the load resolves it
    (model/source.py: no torch), its config's model_type read alone."""
    from pagedserve.model.families import VISION_MODEL_TYPES
    from pagedserve.model.source import ModelLoadError, resolve_model
    if args.mmproj:
        return True
    try:
        src = resolve_model(args.model, args.revision)
    except ModelLoadError:
        return False                    # the load reports it
    if src.kind != "hf":
        return False                    # a GGUF: text unless --mmproj
    try:
        with open(os.path.join(src.path, "config.json")) as f:
            return json.load(f).get("model_type") in VISION_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False                    # no readable config: the load says what is wrong
