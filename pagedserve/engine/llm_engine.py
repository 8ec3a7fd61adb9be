"""LLMEngine: the frontend of one EngineCore. add_request / step / abort: it tokenizes, builds the
core's request message, keeps the one registry of user requests (request id -> RequestState: detokenizer,
stop strings, logprobs, the stream's unsent deltas) and turns the core's token ids into RequestOutputs.
It reaches the core through one door, a CoreClient (engine/core_client.py): the protocol's messages
(engine/wire.py) in and out, the core in this process or (EngineArgs.engine_process) in its own. What its
users may know of the core is `engine.info` (EngineInfo: limits, vocabulary, EOS ids, classes; frozen) and
what its named methods return in values (`stats`, `scheduler_view`, `cache_view`, the LoRA adapters').
`engine.core` (the core's objects) exists in process only, for core-side tools (the calibration, tests)."""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import replace

from pagedserve.config import EngineArgs
from pagedserve.core.request import RequestStatus, fork_id
from pagedserve.engine.core_client import CoreClient, InProcClient, build_core
from pagedserve.engine.startup import StartupTimer
from pagedserve.engine.multimodal import check_image
from pagedserve.engine.info import CoreStats, EngineInfo
from pagedserve.engine.output_processor import OutputProcessor, RequestState
from pagedserve.engine.outputs import EngineCounters, RequestFailure, RequestOutput, StepStats
from pagedserve.engine.wire import (AddRequest, CheckFits, FinishRequests, GetView, LoadLora, Precompile,
                                    UnloadLora)
from pagedserve.errors import ParamError
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import PoolingParams, SamplingParams

log = logging.getLogger("pagedserve")

Delivery = tuple[RequestState, RequestOutput]      # an output and the state of the request it belongs to


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, startup: StartupTimer | None = None,
                 warm_at_load: bool = True, client: CoreClient | None = None, **kwargs):
        """startup: the start-up record to time into (the CLI's, begun before its imports); read `engine.startup`.
        warm_at_load False: GEMM shapes are built by `warm_idle` calls after the load (serve's idle time).
        client: the door to an already built core; else one is made from args (engine_process: a process)."""
        args = args or EngineArgs(**kwargs)
        self.args = args
        if client is None and args.engine_process:
            from pagedserve.engine.core_spawn import spawn_core_for
            spawned = spawn_core_for(args, warm_at_load)
            if spawned is not None:
                from pagedserve.engine.core_proc import ProcClient
                client = ProcClient(args, spawned, startup)
        if client is None:
            from pagedserve.engine.views import engine_info
            core = build_core(args, startup, warm_at_load)
            client = InProcClient(core, engine_info(core))
        self.client = client
        self.info: EngineInfo = client.info
        self.startup: StartupTimer = client.startup
        self.tokenizer = client.tokenizer
        self.images = client.images                      # a vision-language model's image inputs (else None)
        self.states: dict[str, RequestState] = {}        # user request id (= its first sequence's id) -> state
        self.counters = EngineCounters()                 # this side's totals: prompt and generated tokens, finishes
        self.outputs = OutputProcessor(self.tokenizer, self.counters)
        self._last_stats = StepStats()
        self.steps_taken = 0                             # StepOutputs taken (a core in its own process: not
                                                         # every step() call takes one)
        self._ids = itertools.count()

    @property
    def core(self):
        """The core's objects, for core-side tools and tests; in process only."""
        if not isinstance(self.client, InProcClient):
            raise AttributeError("core: the engine core runs in its own process (engine_process)")
        return self.client.core

    def shutdown(self) -> None:
        """Stop the core (its tensor-parallel workers, its process). Idempotent."""
        self.client.shutdown()

    # ------------------------------------------------------------ the core's state, in values (engine thread)
    def stats(self, shared: bool = False) -> CoreStats:
        """The core's state now: the last step's record, running totals, queues, pool, classes (shared: also
        the blocks sharing saved, a walk over the pool). Token and finish totals are this side's, the step record
        and the step count the last step this side took (a core in its own process may have run more since:
        a step record and the count it is read beside always agree)."""
        s = self.client.stats(shared)
        c, last = self.counters, self._last_stats
        return replace(s, step=last, counters=replace(s.counters, prompt_tokens=c.prompt_tokens,
                                                      generation_tokens=c.generation_tokens, finished=dict(c.finished),
                                                      steps=last.index if last.index else s.counters.steps))

    def last_step(self) -> StepStats:
        """The last step's record alone (what a per-step hook needs; cheaper than stats())."""
        return self._last_stats

    def scheduler_view(self) -> dict:
        """/debug/scheduler's queues, classes, pool and limits."""
        return self.client.call(GetView("scheduler"))

    def cache_view(self) -> dict:
        """The dashboard's pool and queues, block by block."""
        return self.client.call(GetView("cache"))

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """ParamError (naming the field) when a prompt of this length with max_tokens could never run here."""
        self.client.call(CheckFits(prompt_len, max_tokens))

    def precompile(self, params: SamplingParams | PoolingParams) -> None:
        """Compile a request's constraint ahead, in the caller's thread (a bad schema: ParamError)."""
        self.client.call(Precompile(params))

    # ------------------------------------------------------------ LoRA adapters (enable_lora)
    def lora_names(self) -> frozenset[str]:
        """The loaded adapters' names (in process: safe to read from any thread, as before the door)."""
        return self.client.call(GetView("lora_names"))

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each loaded adapter."""
        return self.client.call(GetView("loras"))

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder under `name` (ParamError names the field); engine thread."""
        self.client.call(LoadLora(name, path))

    def unload_lora(self, name: str) -> bool:
        """Unload an adapter (False: none of that name); engine thread."""
        return self.client.call(UnloadLora(name))

    def warm_idle(self) -> bool:
        """Build a slice of the GEMM shapes left from the load (EngineCore.warm_idle); True while some remain."""
        return self.client.warm_idle()

    def check_alive(self) -> None:
        """EngineDeadError once the core is gone (its process exited or missed its heartbeat)."""
        self.client.check_alive()

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
        if isinstance(data, dict) and "video" in data:
            raise ParamError(f"{param}.video", f"{param}.video: video inputs are not supported (images only: "
                                               "{'image': an image or a list of them})")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ParamError(param, f"{param}: takes {{'image': an image or a list of them}} only")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if self.images is None:
            raise ParamError(param, f"{param}: this model ({self.info.arch}) takes no images")
        images = [check_image(img, f"{param}.image") for img in images]
        return self.images.expand(ids, images, param)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | PoolingParams | None = None,
                    **kwargs) -> str:
        """submit, then the core's verdict awaited: ParamError / QueueFullError raised with no state left."""
        request_id, verdict = self.submit(request_id, prompt, params, **kwargs)
        if verdict is not None:
            try:
                verdict.result()
            except BaseException:
                self.states.pop(request_id, None)
                raise
        return request_id

    def submit(self, request_id: str | None, prompt, params: SamplingParams | PoolingParams | None = None,
               priority: int = 0, stream: bool = False, arrival_time: float | None = None,
               traffic_class: str | None = None, lora_request: LoRARequest | None = None,
               sink: object = None) -> tuple[str, Future | None]:
        """A generation (SamplingParams) or an embedding (PoolingParams: its prompt is run, its final
        hidden states pooled; one greedy token is sampled and dropped, so it finishes like any request).
        `lora_request`: the LoRA adapter it runs with (enable_lora). `sink`: where a frontend delivers
        its outputs (AsyncLLMEngine's RequestStream), kept in its RequestState: the one registry.
        Returns its id and the core's verdict: None when the core took it (in process: its refusal is raised
        here), else a Future of it (a core in its own process: a burst's adds cross in one message each, not
        one round trip each; on a refusal the caller drops the state with `states.pop`)."""
        info = self.info
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
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError("lora_request must be a LoRARequest")
        text, ids = self.tokenize(prompt)
        ids = info.fit_prompt(ids)
        ids, mm = self._images(prompt, ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else info.max_model_len - len(ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        verdict = self.client.add(AddRequest(    # in process: raises ParamError / QueueFullError, no state made
            request_id, tuple(ids), params, max(1, max_tokens), () if params.ignore_eos else info.eos_token_ids,
            priority, klass, params.n, arrival, None if params.seed is None else params.seed % 2**64,
            pooling=pooling, lora=lora_request, mm_features=mm))
        self.states[request_id] = self.outputs.new_state(RequestState(
            request_id, text, ids, params, stream, params.n, arrival, klass, sink))
        return request_id, verdict

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
        # every sample's sequence, forks the frontend has not seen yet included (the core may be ahead of it)
        seqs = (request_id, *(fork_id(request_id, i) for i in range(1, st.num_samples)))
        self.client.finish(FinishRequests(seqs, status.value))
        self.outputs.end(st, status.value)
        return st, self.outputs.output(st)

    def held(self) -> dict[str, int]:
        """Entries per request-keyed structure of the engine and its core (every count is 0 once all
        requests have finished, whatever way they ended): what a soak checks for per-request leaks."""
        return {"engine.states": len(self.states), **self.client.call(GetView("held"))}

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or sequences that ended since the last step (one more step tells the
        runner to drop their state)."""
        return bool(self.states) or self.client.has_unfinished()

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One core step, its token ids made outputs (step_states without the states)."""
        return [out for _, out in self.step_states()]

    def step_states(self) -> list[Delivery]:
        """One core step, its token ids made outputs, each with its request's state (whose `sink` says
        where a frontend delivers it). A fault in the core's step fails the requests it ran, a fault in
        making one request's output fails that request alone (finish reason "error"); a fault in the
        scheduler raises EngineDeadError."""
        so = self.client.step()
        if so is None:                              # (a core in its own process: no step came in the wait)
            return []
        co, self._last_stats = so.outputs, so.stats
        self.steps_taken += 1
        outs = [self.end(rid, RequestStatus.FINISHED_ERROR, co.error) for rid in co.failed]
        # A core in its own process may send what a request this side has already ended (aborted: the
        # client left) made in a step it ran meanwhile: dropped, as its tokens are (in process it cannot).
        touched: dict[str, RequestState] = {}
        for rid, lps in co.prompt_logprobs.items():
            if (st := self.states.get(rid)) is not None:    # prompt chunks run before any fork: rid is its own
                touched[rid] = st
                st.prompt_logprobs.extend(lps)
        for rid, vec in co.embeddings.items():
            if (st := self.states.get(rid)) is not None:
                st.embedding = vec
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
            self.client.finish(FinishRequests(tuple(stopped), RequestStatus.FINISHED_STOPPED.value))
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
