"""LLMEngine: the frontend of one EngineCore. add_request / step / abort: it tokenizes, builds the
core's Request, keeps the one registry of user requests (request id -> RequestState: detokenizer,
stop strings, logprobs, the stream's unsent deltas) and turns the core's token ids into
RequestOutputs. What its users may know of the core is `engine.info` (EngineInfo: limits, vocabulary, EOS
ids, classes; frozen) and what its named methods return in values (`stats`, `scheduler_view`, `cache_view`,
the LoRA adapters'): the core's objects (scheduler, KV cache manager, runner) stay behind `engine.core`,
which only this class and core-side tools (the calibration, tests of the core) touch."""
from __future__ import annotations

import itertools
import logging

from pagedserve.config import EngineArgs
from pagedserve.core.request import Request, RequestStatus
from pagedserve.engine.core import EngineCore
from pagedserve.engine.startup import StartupTimer
from pagedserve.engine.encoder_core import EncoderCore, is_encoder_folder
from pagedserve.engine.multimodal import check_image
from pagedserve.model.loader import resolve_model
from pagedserve.engine.info import CoreStats, EngineInfo
from pagedserve.engine.output_processor import OutputProcessor, RequestState
from pagedserve.engine.outputs import RequestFailure, RequestOutput, StepStats
from pagedserve.engine.views import cache_view, core_stats, engine_info, scheduler_view
from pagedserve.errors import ParamError
from pagedserve.lora_request import LoRARequest, lora_id
from pagedserve.sampling_params import PoolingParams, SamplingParams

log = logging.getLogger("pagedserve")

Delivery = tuple[RequestState, RequestOutput]      # an output and the state of the request it belongs to


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, startup: StartupTimer | None = None,
                 warm_at_load: bool = True, **kwargs):
        """startup: the start-up record to time into (the CLI's, begun before its imports); read `engine.startup`.
        warm_at_load False: GEMM shapes are built by `warm_idle` calls after the load (serve's idle time)."""
        args = args or EngineArgs(**kwargs)
        # a sentence-transformers encoder (BERT-like) only embeds: its core runs no KV pool (encoder_core.py)
        encoder = is_encoder_folder(resolve_model(args.model, args.revision))
        self.args = args
        self.core = (EncoderCore if encoder else EngineCore)(args, startup, warm_at_load=warm_at_load)
        self.info: EngineInfo = engine_info(self.core)
        self.startup: StartupTimer = self.core.startup
        self.tokenizer = self.core.tokenizer
        self.images = self.core.images                   # a vision-language model's image inputs (else None)
        self.states: dict[str, RequestState] = {}        # user request id (= its first sequence's id) -> state
        self.outputs = OutputProcessor(self.tokenizer, self.core.counters)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the core's tensor-parallel workers (nothing to do with one rank). Idempotent."""
        self.core.shutdown()

    # ------------------------------------------------------------ the core's state, in values (engine thread)
    def stats(self, shared: bool = False) -> CoreStats:
        """The core's state now: the last step's record, running totals, queues, pool, classes (shared: also
        the blocks sharing saved, a walk over the pool)."""
        return core_stats(self.core, shared)

    def last_step(self) -> StepStats:
        """The last step's record alone (what a per-step hook needs; cheaper than stats())."""
        return self.core.last_stats

    def scheduler_view(self) -> dict:
        """/debug/scheduler's queues, classes, pool and limits."""
        return scheduler_view(self.core)

    def cache_view(self) -> dict:
        """The dashboard's pool and queues, block by block."""
        return cache_view(self.core)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """ParamError (naming the field) when a prompt of this length with max_tokens could never run here."""
        self.core.scheduler.check_fits(prompt_len, max_tokens)

    def precompile(self, params: SamplingParams | PoolingParams) -> None:
        """Compile a request's constraint ahead, in the caller's thread (a bad schema: ParamError)."""
        self.core.precompile(params)

    # ------------------------------------------------------------ LoRA adapters (enable_lora)
    def lora_names(self) -> frozenset[str]:
        """The loaded adapters' names (replaced whole on every load and unload: safe to read from any thread)."""
        return frozenset() if self.core.loras is None else self.core.loras.names

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each loaded adapter; engine thread."""
        return [] if self.core.loras is None else [(n, e.path) for n, e in self.core.loras.by_name.items()]

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder under `name` (ParamError names the field); engine thread."""
        self._loras().load(name, path)

    def unload_lora(self, name: str) -> bool:
        """Unload an adapter (False: none of that name); engine thread."""
        return self._loras().unload(name)

    def _loras(self):
        if self.core.loras is None:
            raise ParamError("lora_name", "lora_name: the engine runs without LoRA (enable_lora)")
        return self.core.loras

    def warm_idle(self) -> bool:
        """Build a slice of the GEMM shapes left from the load (EngineCore.warm_idle); True while some remain."""
        return self.core.warm_idle()

    # ------------------------------------------------------------ requests
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            prompt = prompt["prompt"]               # vLLM's TextPrompt: {"prompt": text, "multi_modal_data": ...}
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ParamError("prompt", "prompt must be a string, a list of token ids or {'prompt_token_ids': [...]}")
        self.info.check_token_ids("prompt", ids, "prompt_token_ids")
        return (prompt.get("prompt") if isinstance(prompt, dict) else None), list(ids)

    def _images(self, prompt, ids: list[int]) -> tuple[list[int], tuple]:
        """A prompt's images (vLLM's {"multi_modal_data": {"image": img | [img, ...]}}): its placeholders
        expanded, an MMFeature per image (engine/multimodal.py); ParamError names the field."""
        if isinstance(prompt, dict) and "mm_features" in prompt:    # the server expanded them (engine/multimodal.py)
            return ids, tuple(prompt["mm_features"])
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            if self.images is not None and self.images.token_id in ids:   # HF refuses it too
                raise ParamError("prompt", "prompt: it holds image placeholder tokens and no image was given")
            return ids, ()
        param = "multi_modal_data"
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ParamError(param, f"{param}: takes {{'image': an image or a list of them}} only")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if self.images is None:
            raise ParamError(param, f"{param}: this model ({self.info.arch}) takes no images")
        images = [check_image(img, f"{param}.image") for img in images]
        return self.images.expand(ids, images, param)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, stream: bool = False, arrival_time: float | None = None,
                    traffic_class: str | None = None, lora_request: LoRARequest | None = None,
                    sink: object = None) -> str:
        """A generation (SamplingParams) or an embedding (PoolingParams: its prompt is run, its final
        hidden states pooled; one greedy token is sampled and dropped, so it finishes like any request).
        `lora_request`: the LoRA adapter it runs with (enable_lora). `sink`: where a frontend delivers
        its outputs (AsyncLLMEngine's RequestStream), kept in its RequestState: the one registry."""
        core, info = self.core, self.info
        pooling = None
        if isinstance(params, PoolingParams):
            pooling = params.resolved(self.args.pooling, info.model_pooling, info.hidden_size, info.pooling_types)
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if params.use_beam_search:
            raise ParamError("use_beam_search", "use_beam_search: beam search runs through LLM.beam_search / "
                                                "LLM.generate, not engine.add_request")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ParamError("priority", f"priority must be an integer, got {priority!r}")
        classes = info.traffic_classes
        if traffic_class is not None and classes is None:
            raise ParamError("traffic_class", f"traffic_class: {traffic_class!r} names a class, but the server "
                                              "runs without --traffic-classes")
        klass = classes.resolve(priority, traffic_class) if classes is not None else 0
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        info.check_token_ids("stop_token_ids", params.stop_token_ids)
        info.check_token_ids("logit_bias", params.logit_bias or ())
        text, ids = self.tokenize(prompt)
        ids = core.fit_prompt(ids)          # an encoder truncates as sentence-transformers does
        ids, mm = self._images(prompt, ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else info.max_model_len - len(ids)
        req = Request(request_id, ids, params, max_tokens=max(1, max_tokens),
                      eos_token_ids=() if params.ignore_eos else info.eos_token_ids, priority=priority,
                      traffic_class=klass,
                      num_samples=params.n, generator_seed=None if params.seed is None else params.seed % 2**64)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        req.pooling = pooling
        req.lora_id = lora_id(core.loras, lora_request)
        req.mm_features = mm
        core.add(req)                   # raises ParamError / QueueFullError before any state exists
        self.states[request_id] = self.outputs.new_state(RequestState(
            request_id, text, ids, params, stream, params.n, req.arrival_time, klass, sink))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request because its client went away (or asked): finish reason "abort"."""
        ended = self.end(request_id, RequestStatus.FINISHED_ABORTED)
        return ended and ended[1]

    def fail_request(self, request_id: str, error: RequestFailure) -> RequestOutput | None:
        """End a request with an error (a fault in its step, a timeout, shutdown): finish reason "error"."""
        ended = self.end(request_id, RequestStatus.FINISHED_ERROR, error)
        return ended and ended[1]

    def end(self, request_id: str, status: RequestStatus, error: RequestFailure | None = None) -> Delivery | None:
        """End a request now (abort or failure; None if it has ended already): its state and last output."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        st.error = error
        self.core.finish([s.seq_id for s in st.seqs], status)
        self.outputs.end(st, status.value)
        return st, self.outputs.output(st)

    def held(self) -> dict[str, int]:
        """Entries per request-keyed structure of the engine and its core (every count is 0 once all
        requests have finished, whatever way they ended): what a soak checks for per-request leaks."""
        return {"engine.states": len(self.states), **self.core.held()}

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or sequences that ended since the last step (one more step tells the
        runner to drop their state)."""
        return bool(self.states) or self.core.has_unfinished()

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One core step, its token ids made outputs (step_states without the states)."""
        return [out for _, out in self.step_states()]

    def step_states(self) -> list[Delivery]:
        """One core step, its token ids made outputs, each with its request's state (whose `sink` says
        where a frontend delivers it). A fault in the core's step fails the requests it ran, a fault in
        making one request's output fails that request alone (finish reason "error"); a fault in the
        scheduler raises EngineDeadError."""
        co = self.core.step()
        outs = [self.end(rid, RequestStatus.FINISHED_ERROR, co.error) for rid in co.failed]
        touched: dict[str, RequestState] = {}
        for rid, lps in co.prompt_logprobs.items():
            st = touched[rid] = self.states[rid]    # prompt chunks run before any fork: rid is the request's own
            st.prompt_logprobs.extend(lps)
        for rid, vec in co.embeddings.items():
            self.states[rid].embedding = vec
        stopped = []
        for t in co.tokens:
            st = self.states.get(t.owner_id)
            if st is None:                          # its output failed earlier in this step
                continue
            touched[t.owner_id] = st
            try:
                if self.outputs.observe(st, t):
                    stopped.append(t.seq_id)
            except Exception as e:
                outs.append(self._fault(st, e))
        if stopped:                                 # stop strings: the core ends those sequences now
            self.core.finish(stopped, RequestStatus.FINISHED_STOPPED)
        for st in touched.values():
            if (st.stream or st.finished) and st.request_id in self.states:
                try:
                    outs.append((st, self.outputs.output(st)))
                except Exception as e:
                    outs.append(self._fault(st, e))
                    continue
                if st.finished:
                    del self.states[st.request_id]
        return [o for o in outs if o is not None]

    def _fault(self, st: RequestState, e: Exception) -> Delivery | None:
        log.exception("making request %s's output failed; failing that request", st.request_id)
        err = RequestFailure("internal_error", f"making this request's output failed: {type(e).__name__}: {e}")
        try:
            return self.end(st.request_id, RequestStatus.FINISHED_ERROR, err)
        except Exception:           # not even its failed output can be made: the failure alone (state gone)
            log.exception("request %s: no output to fail it with", st.request_id)
            return st, RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, [], True, error=err)
