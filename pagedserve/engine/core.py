"""EngineCore: the scheduler, the executor (which holds the runner) and the KV cache manager.
Token ids in (`add` takes a tokenized `Request`), token ids out (`step` returns `EngineCoreOutputs`: each
sequence's new tokens with their logprobs and finish, in values, the step's failures and one stats
record in `last_stats`). No text, no per-user-request state: those are the frontend's (LLMEngine)."""

from __future__ import annotations

import logging
import os
import time

import torch

from pagedserve import kernels
from pagedserve.config import EngineArgs, SpeculativeConfig
from pagedserve.core.grammar import GrammarCompiler
from pagedserve.core.encoder_cache import EncoderCacheManager
from pagedserve.core.kv_layout import KVLayout
from pagedserve.core.request import Request, RequestStatus, owner_id
from pagedserve.core.scheduler import build_kv_cache, build_scheduler
from pagedserve.core.spec_decode import Drafting, measure_draft_costs, measure_step_costs
from pagedserve.core.step import SchedulerOutput
from pagedserve.core.traffic import CLASS_KEYS, TrafficClasses, itl_floor_s, reference_floor_rows, step_headroom
from pagedserve.engine.multimodal import ImageInputs, image_limit
from pagedserve.engine.startup import Background, StartupTimer, activate, mark, phase
from pagedserve.engine.outputs import EngineCoreOutputs, EngineCounters, RequestFailure, SeqTimes, SeqToken, StepStats
from pagedserve.errors import EngineDeadError, ParamError
from pagedserve.model.attention import KV_CACHE_DTYPES, kv_scale_bytes
from pagedserve.host import auto_dtype, auto_kv_cache_dtype, available_memory_bytes, fix_malloc_thresholds, openmp_wait
from pagedserve.distributed.executor import make_executor
from pagedserve.distributed.sharding import check_tensor_parallel
from pagedserve.distributed.worker import CacheSpec
from pagedserve.kv_plan import GiB, pool_blocks, window_plan, workspace_bytes
from pagedserve.model.families import from_transformers
from pagedserve.model.gemm import Warmup
from pagedserve.model.llama import FusedDecode
from pagedserve.model.loader import load_model, read_model_config, read_pooling_config, resolve_model
from pagedserve.lora_request import LoRARegistry
from pagedserve.model.quant import choose_quantization, int8_activations, weight_bytes
from pagedserve.native_build import sources_for
from pagedserve.runner.draft_runner import DraftRunner, load_draft
from pagedserve.runner.model_runner import PROMPT_LOGPROBS_ROWS, RunnerOutput
from pagedserve.sampling_params import POOLING_TYPES, PoolingParams, SamplingParams
from pagedserve.sim.probe import load_probe, probe_cache_path, probe_step_times, save_probe, warm_blocks
from pagedserve.sim.cost_model import PROFILES, FittedCost, LiveCost, RooflineCost, cache_path, shape_of_engine
from pagedserve.tokenizer import load_tokenizer

log = logging.getLogger("pagedserve")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineCore:
    pooling_types = POOLING_TYPES           # what an embedding request may pool by (EncoderCore: + MAX)
    generates = True                        # EncoderCore: False (it only embeds)
    images: ImageInputs | None = None       # a vision-language model's image inputs (None: text only)

    gemm_warmup: Warmup | None = None     # GEMM shapes still to build (serve: in idle time after ready)

    def __init__(self, args: EngineArgs, startup: StartupTimer | None = None, warm_at_load: bool = True):
        """startup: the record to time the build into (the CLI's, which began with the imports); a new one
        when not given. Read it as `engine.startup`. warm_at_load False: the GEMM shapes of
        --warm-gemm-shapes are left for `warm_idle` (serve calls it while no request is in flight)."""
        self.args, self.warm_at_load = args, warm_at_load
        self.startup = timer = startup or StartupTimer()
        with activate(timer):
            self._init(args)
        timer.done()
        mem = {"weights": self.weights_bytes / 2**20, "KV pool": self.kv_cache_bytes / 2**20}
        log.info("%s", timer.summary(mem))

    def _init(self, args: EngineArgs) -> None:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device cuda: no CUDA device is visible (torch {torch.__version__}"
                             f"{', built without CUDA' if torch.version.cuda is None else ''})")
        log.info("malloc: %s", fix_malloc_thresholds())
        log.info("OpenMP idle threads: %s", openmp_wait())
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        t0 = time.perf_counter()
        with phase("resolve model"):
            self.source = resolve_model(args.model, args.revision)
            self.source.mmproj = args.mmproj
            dtype_name, why = auto_dtype(args.device) if args.dtype == "auto" else (args.dtype, "asked for")
            log.info("dtype %s (%s)", dtype_name, why)
        with phase("executor"):
            if args.tensor_parallel_size > 1:       # before any worker starts
                check_tensor_parallel(read_model_config(self.source), args.tensor_parallel_size)
            self.executor = make_executor(args, self.source, dtype_name)
        try:
            self._build(_DTYPES[dtype_name])
        except BaseException:
            self.executor.shutdown()
            raise
        self.load_s = time.perf_counter() - t0
        self.counters = EngineCounters()
        self.last_stats = StepStats()
        self.last_schedule: SchedulerOutput | None = None     # what the last step ran (calibration reads it)

    def _build(self, dtype: torch.dtype) -> None:
        """Load this rank's model, plan memory, build the cache manager, the scheduler and the runners."""
        args, tp = self.args, self.executor.tp
        if self.source.kind == "hf":    # this thread reads config.json through transformers during the load:
            for name in ("AutoConfig", "AutoTokenizer", "__version__"):     # resolved here first, so the
                from_transformers(name)  # tokenizer's thread never resolves its lazy module beside this one
        tokenizer = Background(load_tokenizer, self.source, True)   # beside the builds and the load (issue 56)
        if args.device == "cpu":        # cold native builds beside each other and the load (issue 56); the CLI
            kernels.prebuild(sources_for(self.source.kind, args.quantization, args.dtype, tp.size))  # began them
        if args.batch_invariant:
            if self.source.kind != "gguf":
                raise ValueError(f"batch_invariant needs a GGUF file (its rows take the packed kernels), and "
                                 f"{self.source.path} is an HF folder")
            self.quantization, dense_copy, why = "gguf", False, "--batch-invariant: every product packed, no dense copies"
        else:
            with phase("kernel builds"):    # auto on a GGUF waits for qmatmul's build (a cold start's)
                self.quantization, dense_copy, why = choose_quantization(args.quantization, self.source.kind,
                                                                         args.dtype, args.device, tp.size)
        log.info("quantization %s (%s)", self.quantization, why)
        int8_act, why = int8_activations(args.dtype, self.quantization)
        if self.quantization != "none":
            log.info("packed products: %s activations (%s)", "int8-rounded" if int8_act else "float", why)
        self.model, self.model_config = load_model(self.source, dtype, args.device, self.quantization, tp, int8_act,
                                                   dense_copy, args.max_num_batched_tokens if args.batch_invariant
                                                   else args.packed_rows)
        if args.batch_invariant and self.model.fused is None:
            raise ValueError(f"batch_invariant needs every layer in the fused native call, and this model's "
                             f"cannot be: {FusedDecode.refusal(self.model)}")
        with phase("tokenizer"):        # (the wait for it: most of its load ran beside the model's)
            self.tokenizer = tokenizer.result()
        log.info("tokenizer: loaded in %.2f s, beside the model load", tokenizer.seconds)
        self.model_pooling = read_pooling_config(self.source)     # how embedding requests pool by default
        cfg = self.model_config
        self.max_model_len = min(args.max_model_len or min(cfg.max_position_embeddings, 8192),
                                 cfg.max_position_embeddings)
        self.weights_bytes = weight_bytes(self.model) * tp.size
        self.workspace_bytes = workspace_bytes(cfg, args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len,
                                               dtype.itemsize)
        if args.kv_cache_dtype == "auto":
            kv_name, why = auto_kv_cache_dtype(args.device, args.dtype, str(dtype).removeprefix("torch."))
            kv_dtype = KV_CACHE_DTYPES[kv_name]
            log.info("KV cache dtype %s (auto: %s)", kv_name, why)
        else:
            kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
        self.kv_cache_dtype_name = str(kv_dtype).removeprefix("torch.")
        # bytes of one token in every layer (full attention everywhere: the seed's arithmetic)
        self.kv_cache_bytes_per_token = cfg.kv_bytes_per_token(kv_dtype.itemsize, kv_scale_bytes(kv_dtype))
        layout = cfg.kv_layout
        if args.disable_hybrid_kv_cache_manager and layout.windows != (0,):  # one table, every layer's KV kept
            layout = KVLayout.uniform(cfg.num_layers)
        self.kv_layout = layout
        # a block id spans `planes` layers (all of them, unless groups of layers have tables of their own)
        self.kv_block_bytes = self.kv_cache_bytes_per_token // cfg.num_layers * layout.planes * args.block_size
        spec = SpeculativeConfig.parse(args.speculative_config)
        draft = load_draft(spec, args, dtype, layout, cfg, self.tokenizer) \
            if spec is not None and spec.method == "draft_model" else None
        if draft is not None:          # its KV lives in the same block ids: a block holds both models' slices
            self.kv_block_bytes += draft.cfg.kv_bytes_per_token(kv_dtype.itemsize, kv_scale_bytes(kv_dtype)) \
                * args.block_size
            self.weights_bytes += weight_bytes(draft)
        # every GEMM shape a step can meet built now, before the plan reads the free memory (model/gemm.py)
        k = spec.num_speculative_tokens if spec is not None else 0
        head_rows = min(args.max_num_batched_tokens, max(args.max_num_seqs * (1 + k), PROMPT_LOGPROBS_ROWS))
        mark("plan")
        with phase("GEMM shapes"):
            if args.warm_gemm_shapes:
                jobs = [m.gemm_warmup(args.max_num_batched_tokens, head_rows) for m in (self.model, draft)
                        if m is not None]
                self.gemm_warmup = Warmup([p for job in jobs for p in job.products], note=jobs[0].note)
                if self.warm_at_load:
                    log.info("GEMM shapes: %s", self.gemm_warmup.run())
                elif not self.gemm_warmup.done:
                    self.startup.pending.append("GEMM shapes")
                    log.info("GEMM shapes: %d distinct products, every row bucket, built in the idle time after "
                             "ready", len(self.gemm_warmup.keys))
            else:
                log.info("GEMM shapes: built as steps meet them (--no-warm-gemm-shapes)")
        with phase("KV pool"):
            encoder = self._build_pool(args, cfg, layout, kv_dtype, draft)
        with phase("finish"):
            self._finish(args, cfg, spec, draft, encoder)

    def _build_pool(self, args: EngineArgs, cfg, layout: KVLayout, kv_dtype: torch.dtype,
                    draft) -> EncoderCacheManager | None:
        """The KV pool sized, the cache manager and the runner (which allocates the pool); returns a
        vision-language model's encoder cache (for the scheduler, built last: _finish)."""
        num_blocks = self._size_kv_pool(kv_dtype)
        self.kv = build_kv_cache(args, self.max_model_len, num_blocks, self.kv_block_bytes, layout.windows)
        num_host = self.kv.num_host_blocks
        self.images, encoder = self._images(args, cfg)
        if cfg.layer_windows:
            log.info("%s", window_plan(cfg, layout, self.kv_cache_bytes_per_token))
        # every rank allocates the same block ids; each holds its own KV heads (all ranks together: the plan)
        graphs_off = "not on CUDA" if args.device != "cuda" else "enforce_eager" if args.enforce_eager \
            else "LoRA adapters" if args.enable_lora else None
        graphs = None if graphs_off else (args.max_num_seqs, self.max_model_len)
        self.runner = self.executor.init_runner(self.model, CacheSpec(num_blocks, args.block_size, num_host,
                                                                      kv_dtype, args.seed, layout,
                                                                      args.attention_backend, graphs,
                                                                      args.batch_invariant))
        if args.batch_invariant and not self.runner.use_native:
            raise ValueError(f"batch_invariant needs the native attention kernels, and this engine's is "
                             f"{self.runner.attention_backend} (--attention-backend {args.attention_backend})")
        log.info("attention: %s (--attention-backend %s); CUDA graphs: %s", self.runner.attention_backend,
                 args.attention_backend, f"off ({graphs_off})" if graphs_off else self.runner.graphs_note)
        if draft is not None:
            self.runner.drafter = DraftRunner(draft, num_blocks, args.block_size, kv_dtype)
        self.kv_cache_bytes = self.runner.kv_cache_bytes * self.executor.tp.size + (
            self.runner.drafter.kv_cache_bytes if draft is not None else 0)
        return encoder

    def _images(self, args: EngineArgs, cfg) -> tuple[ImageInputs | None, EncoderCacheManager | None]:
        """A vision-language model's image inputs (engine/multimodal.py: the processor, the placeholder's
        expansion, the per-prompt limit) and its encoder budget and cache (core/encoder_cache.py); a text
        model: (None, None)."""
        if cfg.vision is None:
            return None, None
        if args.enable_lora:
            raise ValueError("enable_lora: LoRA adapters are not supported with a vision-language model")
        seq_len, whole = cfg.vision.image_seq_len, getattr(cfg.vision, "bidirectional", False)
        if whole and args.max_num_batched_tokens < seq_len:     # (an image is never split across prefill chunks)
            raise ValueError(f"max_num_batched_tokens {args.max_num_batched_tokens} is less than the {seq_len} tokens "
                             "of one image, whose tokens attend to each other both ways and prefill in one step")
        if whole and args.batch_invariant:
            raise ValueError("batch_invariant: every prompt row a decode row cannot attend both ways over an "
                             "image's tokens (Gemma 3); not supported with this model")
        images = ImageInputs(self.source.path, cfg.vision, image_limit(args.limit_mm_per_prompt), self.tokenizer)
        budget = max(args.encoder_budget_tokens or args.max_num_batched_tokens, seq_len)
        capacity = max(args.encoder_cache_tokens or 4 * budget, seq_len)
        log.info("images: %d tokens each, at most %d per prompt; encoder budget %d tokens a step, cache %d tokens%s",
                 seq_len, images.limit, budget, capacity, "; never split across prefill chunks" if whole else "")
        return images, EncoderCacheManager(capacity, budget, whole_images=whole)

    def _finish(self, args: EngineArgs, cfg, spec, draft, encoder: EncoderCacheManager | None) -> None:
        """Everything after the pool: EOS ids, the grammar compiler, traffic classes, LoRA, speculation, and the
        scheduler built with them."""
        classes = TrafficClasses.parse(args.traffic_classes)
        self.eos_token_ids = tuple(dict.fromkeys(cfg.eos_token_ids + (
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])))
        self.step_cost = None                 # the step-time model an ITL target sizes prefill with
        self.startup_itl_floor_ms = None      # traffic classes: the ITL floor by reference_floor_rows (ms)
        if classes is not None:
            self.step_cost = self._live_cost()
            if self.step_cost.model is None and classes.has_time_targets:
                self._probe_step_cost(args)
            log.info("traffic classes: %s", "; ".join(
                f"{c.name} (priority {c.priority}" + "".join(f", {k} {getattr(c, k)}" for k in CLASS_KEYS[2:]
                                                             if getattr(c, k) is not None) + ")" for c in classes))
            self._check_floor(classes, args.strict_slo)
        self.scheduler = build_scheduler(args, self.max_model_len, self.kv, encoder=encoder, step_cost=self.step_cost,
                                         grammar=GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids),
                                         drafting=self._drafting(args, spec, draft))
        self.loras = None if not args.enable_lora else LoRARegistry(     # the adapters (weights: the runner)
            args, self.runner, cfg, lambda: {r.lora_id for r in self.scheduler.requests.values()})

    def _drafting(self, args: EngineArgs, spec, draft) -> Drafting | None:
        """Speculative decoding's configuration of the scheduler: with adaptive drafting, the step costs
        measured now on this host (the target's, and a draft model's)."""
        if spec is None:
            return None
        if not spec.adaptive:
            log.info("speculative decoding: %s, %d draft tokens whenever proposed (adaptive off)", spec.method,
                     spec.num_speculative_tokens)
            return Drafting(spec)
        cost, row_s = measure_step_costs(self.executor.execute, self.kv, args, self.max_model_len,
                                         spec.num_speculative_tokens)
        log.info("speculative decoding: %s, up to %d draft tokens; step time by rows (ms) %s; a prefill chunk's "
                 "row %.2f ms", spec.method, spec.num_speculative_tokens,
                 " ".join(f"{r}:{t * 1e3:.1f}" for r, t in cost.as_dict().items()), row_s * 1e3)
        if draft is None:
            return Drafting(spec, cost, row_s)
        dcost, read_s = measure_draft_costs(self.runner.drafter, self.kv, args)
        log.info("speculative decoding: draft model %s; its proposing pass by sequences (ms) %s; reading "
                 "context %.2f ms/token", spec.model, " ".join(f"{r}:{t * 1e3:.1f}" for r, t in
                                                              dcost.as_dict().items()), read_s * 1e3)
        return Drafting(spec, cost, row_s, dcost, read_s)

    def _check_floor(self, classes: TrafficClasses, strict: bool) -> None:
        """The ITL floor at start-up (traffic.reference_floor_rows: a decode beside the other classes' least
        work at max_model_len), logged; a class's itl_p99_ms under it is warned about, or refused (strict_slo)."""
        if classes.itl_target_s is None:
            return
        if self.step_cost.model is None:
            if strict:
                raise ValueError("strict_slo: no step-time model for this host to check itl_p99_ms against (run "
                                 "`pagedserve simulate --calibrate` once to cache one)")
            log.info("traffic classes: ITL floor unknown until the step-time model is fitted (after %d steps); "
                     "then in /debug/scheduler and on /metrics", LiveCost.MIN_SAMPLES)
            return
        floor_ms = 1e3 * itl_floor_s(self.step_cost, reference_floor_rows(len(classes) - 1, self.max_model_len))
        self.startup_itl_floor_ms = floor_ms
        log.info("traffic classes: ITL floor %.1f ms (a decode beside the other classes' least work at %d tokens "
                 "of context, predicted over the %.2f headroom)", floor_ms, self.max_model_len,
                 step_headroom(self.step_cost))
        for line in classes.floor_warnings(floor_ms):
            if strict:
                raise ValueError(f"strict_slo: {line}")
            log.warning("%s", line)

    def _probe_step_cost(self, args: EngineArgs) -> None:
        """No calibration cached for this host: time a few steps now (sim.probe.probe_step_times, ~2-3 s on a
        2-core CPU) and fit the live model on them, so the first steps of traffic are planned by this host's
        own times and the floor is known at start-up (issue 54: a roofline prior left the first steps of a
        flood uncut, 1-5 s each, and set the run's TTFT p99). The samples are kept in the cache folder, keyed as
        the calibration is (host, model, dtypes, block size): the next start reads them instead of probing."""
        t0, path = time.perf_counter(), probe_cache_path(cache_path(args))
        with phase("step-time probe"):
            samples, how = load_probe(path), "read from the cache"
            touch = self.runner.touch_blocks if self.executor.tp.size == 1 else None
            if samples is not None:
                warm_blocks(self.kv, self.max_model_len, touch)
            else:
                samples, how = probe_step_times(self.executor.execute, self.kv, self.max_model_len,
                                                args.max_num_batched_tokens, touch), "timed"
                if samples:
                    save_probe(path, samples)
            for rows, seconds in samples:
                self.step_cost.observe(rows, seconds)
        cost = self.step_cost
        if cost.model is None:
            log.info("step-time probe: %d steps timed, too few to fit (a pool or budget too small); the roofline "
                     "until %d steps have run", len(samples), LiveCost.MIN_SAMPLES)
            return
        log.info("step-time probe: %d steps %s in %.1f s, fitted (median relative error %.0f %%; one decode "
                 "%.1f ms, a 16-token chunk beside it %.1f ms); refitted as steps run", len(samples), how,
                 time.perf_counter() - t0, 100 * cost.model.rel_error_p50, 1e3 * cost([(16, 1, 1)]),
                 1e3 * cost([(16, 1, 1), (0, 16, 0)]))

    def _live_cost(self) -> LiveCost:
        """The step-time model of `pagedserve simulate --calibrate`, refitted while serving on this
        engine's own steps; seeded with this host's cached calibration when there is one."""
        path, seed = cache_path(self.args), None
        if os.path.exists(path):
            seed = FittedCost.load(path)
        shape = shape_of_engine(self)
        prior = RooflineCost(shape, PROFILES["h100" if self.args.device == "cuda" else "cpu"])
        cost = LiveCost(shape, seed, prior)
        log.info("step-time model: %s", f"the calibration {path}, refitted as steps run" if seed else
                 f"fitted on the first {LiveCost.MIN_SAMPLES} steps, the {prior.hw.name} roofline until then (no "
                 "calibration cached for this host; `pagedserve simulate --calibrate` makes one), refitted as "
                 "steps run")
        return cost

    def warm_idle(self, budget_s: float = 0.05) -> bool:
        """Build GEMM shapes left from the load for about budget_s (gemm.Warmup.step), in the engine
        thread while no request is in flight; True while some remain."""
        job = self.gemm_warmup
        if job is None or job.done:
            return False
        if job.step(budget_s):
            return True
        self.startup.after_ready["GEMM shapes"] = job.seconds
        self.startup.pending.remove("GEMM shapes")
        log.info("GEMM shapes after ready: %s", job.line())
        return False

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank). Idempotent."""
        self.executor.shutdown()

    def _size_kv_pool(self, kv_dtype: torch.dtype) -> int:
        a, per_block = self.args, self.kv_block_bytes
        free, total = torch.cuda.mem_get_info() if a.device == "cuda" else (available_memory_bytes(), None)
        per_seq = -(-self.max_model_len // a.block_size) * self.kv_layout.num_groups     # a table per layer group
        blocks, how = pool_blocks(a, per_block, self.workspace_bytes, free, total, self.executor.tp.size,
                                  need_blocks=a.max_num_seqs * per_seq + 1)                # + the null block
        kv = f"KV {self.kv_cache_dtype_name}" + (" + float32 scale per token and kv head" if kv_scale_bytes(kv_dtype)
                                                  else "")
        log.info("memory plan: weights %.2f GiB (%s) | workspace ~%.2f GiB (activations at %d tokens/step, logits, "
                 "attention scratch) | %s | KV pool %.2f GiB (%s) = %d blocks x %d tokens = %d tokens at %d bytes/token",
                 self.weights_bytes / GiB, self.model.weights_desc, self.workspace_bytes / GiB,
                 a.max_num_batched_tokens, kv,
                 blocks * per_block / GiB, how, blocks, a.block_size, blocks * a.block_size, per_block // a.block_size)
        return int(blocks)

    # ------------------------------------------------------------ requests
    def precompile(self, params: SamplingParams | PoolingParams) -> None:
        """Compile a request's constraint ahead, in the caller's thread (the server's workers)."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            self.scheduler.grammar.precompile(params.structured_outputs)

    def add(self, req: Request) -> None:
        """Queue a tokenized request (the frontend built it); ParamError / QueueFullError before any
        state exists."""
        if req.params.structured_outputs is not None:
            req.grammar = self.scheduler.grammar.matcher(req.params.structured_outputs)
        self.scheduler.add_request(req)

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None:
        """End these sequences now (a stop string the frontend found, an abort, a failure); a no-op on
        ended ones. An unloaded adapter's weights go with the last sequence that used it."""
        for sid in seq_ids:
            req = self.scheduler.requests.get(sid)
            if req is not None:
                self.scheduler.finish(req, status)
        if self.loras is not None:
            self.loras.drop_retired()

    def held(self) -> dict[str, int]:
        return {**self.scheduler.held(), **self.kv.held(), **self.runner.held()}

    def has_unfinished(self) -> bool:
        """Sequences in flight, or ended since the last step (one more step tells the runner to drop them)."""
        return bool(self.scheduler.requests) or bool(self.scheduler.finished_ids)

    # ------------------------------------------------------------ the step
    def step(self) -> EngineCoreOutputs:
        """One step: schedule, run, apply the sampled tokens. A fault while running fails only the
        requests of this step (EngineCoreOutputs.failed: the frontend ends them with finish reason
        "error"); a fault in the scheduler leaves its state unknown and raises EngineDeadError."""
        t0 = time.perf_counter()
        idle = not self.scheduler.requests      # only ended sequences to report: no step to count
        try:
            so = self.last_schedule = self.scheduler.schedule()
        except Exception as e:
            raise EngineDeadError(f"the scheduler failed ({type(e).__name__}: {e}); engine state is unknown") from e
        try:
            ro = self.executor.execute(so)
            out = EngineCoreOutputs(self._apply(so, ro), ro.prompt_logprobs, ro.embeddings)
        except EngineDeadError:                 # a tensor-parallel rank is gone: nothing local is left
            raise
        except Exception as e:
            log.exception("engine step failed; failing the requests it ran")
            reqs = (self.scheduler.requests.get(s.request_id) for s in so.seqs)
            ro, out = RunnerOutput(), EngineCoreOutputs(failed=tuple(dict.fromkeys(
                owner_id(r) for r in reqs if r is not None)), error=RequestFailure(
                "internal_error", f"the engine step running this request failed: {type(e).__name__}: {e}"))
        if self.loras is not None:
            self.loras.drop_retired()
        step_s = time.perf_counter() - t0
        if not idle:
            self._record_stats(so, ro, step_s)
            if self.step_cost is not None and so.seqs:
                fitted = self.step_cost.model is not None
                self.step_cost.observe(self.last_stats.rows, step_s)
                self.scheduler.observe_step_time(step_s)
                if not fitted and self.step_cost.model is not None:   # the first fit (no calibration cached)
                    self._check_floor(self.scheduler.classes, False)
        return out

    def _apply(self, so: SchedulerOutput, ro: RunnerOutput) -> list[SeqToken]:
        """The scheduler applies the sampled tokens (forks, appends, EOS / stop token / length); each
        becomes a SeqToken, the request's state as of that token in values."""
        sampled = {rid: [smp.token_id for smp in smps] for rid, smps in ro.sampled.items()}
        out = []
        for u in self.scheduler.update_from_output(so, sampled):
            r = u.request
            out.append(SeqToken(r.request_id, owner_id(r), r.seq_index, u.token_id,
                                ro.sampled[u.row_id][u.sample_index].logprobs,
                                r.status.value if u.finished else None, r.stop_reason if u.finished else None,
                                SeqTimes(r.first_scheduled_time, r.first_token_time, r.last_token_time,
                                         r.num_preemptions, max(0, r.num_cached_tokens))))
        return out

    def _record_stats(self, so: SchedulerOutput, ro: RunnerOutput, step_s: float) -> None:
        sch, kv, c = self.scheduler, self.kv, self.counters
        c.steps += 1
        c.preemptions += len(so.preempted)
        c.prefix_queries, c.prefix_hits = kv.prefix_queries, kv.prefix_hits
        free = kv.num_free_blocks
        self.last_stats = StepStats(
            index=c.steps, num_running=len(sch.running), num_waiting=len(sch.waiting),
            num_preempted_waiting=sum(1 for _, r in sch.waiting if r.num_preemptions),
            num_free_blocks=free, num_used_blocks=kv.pool.num_usable_blocks - free,
            num_cached_blocks=kv.pool.num_cached_blocks(), kv_usage=kv.usage(),
            num_prefill_tokens=so.num_prefill_tokens, num_decode_tokens=so.num_decode_tokens,
            num_preemptions=len(so.preempted), num_admitted=so.num_admitted, num_draft_tokens=so.num_draft_tokens,
            step_s=step_s, forward_s=ro.forward_s,
            prepare_s=ro.prepare_s, propose_s=ro.propose_s, sample_s=ro.sample_s,
            rows=tuple((s.start, s.num_tokens, s.sampling.num_samples if s.sampling else 0) for s in so.seqs))

