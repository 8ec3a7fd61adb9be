"""What users see of a request: text (incremental detokenization), stop strings, logprobs, and
`RequestOutput`s. A streaming request gets deltas after every step (only the new tokens, text and
logprobs: O(1) per step however long the generation); any other request gets one full output
when it finishes. Token appends, forks and the other finish checks belong to the scheduler."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.step import SeqUpdate
from pagedserve.engine.outputs import CompletionOutput, RequestFailure, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import IncrementalDetokenizer


@dataclass(slots=True, eq=False)
class SeqOutput:
    """One sequence's text and logprobs. Text is kept as settled parts plus a short pending tail
    that a stop string could still cut; a stream hands its settled parts out (and drops them)
    after every step."""

    request: Request
    detok: IncrementalDetokenizer | None
    hold: int                                   # pending characters kept back (longest stop string - 1)
    parts: list[str] = field(default_factory=list)
    pending: str = ""
    logprobs: list | None = None
    cum_logprob: float = 0.0
    sent_tokens: int = 0                        # tokens already handed out (streams)
    stop: str | None = None                     # the stop string found in its text (finish reason "stop")

    def finish_reason(self) -> str | None:
        """What the client sees: "stop" for a stop string found in the text, else the core's finish."""
        status = self.request.status
        return None if not status.finished else "stop" if self.stop is not None else status.value

    def add_text(self, delta: str) -> None:
        self.pending += delta

    def settle(self) -> None:
        """Move all pending text but the held-back tail (all of it once finished) into parts."""
        keep = 0 if self.request.status.finished else self.hold
        if len(self.pending) > keep:
            cut = len(self.pending) - keep
            self.parts.append(self.pending[:cut])
            self.pending = self.pending[cut:]


@dataclass(slots=True, eq=False)
class RequestState:
    """The engine's view of one user request: its n sequences' outputs. Status and stop reason
    live on each `Request` (the scheduler owns them)."""

    request_id: str
    prompt: str | None
    stream: bool                                # deltas after every step, else one output at the end
    seqs: list[SeqOutput] = field(default_factory=list)
    error: RequestFailure | None = None
    prompt_logprobs: list | None = None         # [None, {...}, ...] as the prompt's chunks are computed
    prompt_logprobs_sent: bool = False
    pool_sum: Any = None                        # an embedding request: float32 sum of its pooled hidden states
    pool_rows: int = 0
    embedding: list[float] | None = None        # the pooled vector, once its prompt is done

    @property
    def params(self) -> SamplingParams:
        return self.seqs[0].request.params

    @property
    def finished(self) -> bool:
        first = self.seqs[0].request
        if self.error is not None or first.status is RequestStatus.FINISHED_ABORTED:
            return True
        return len(self.seqs) == first.num_samples and all(s.request.status.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer, scheduler, counters):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.counters = counters

    def new_state(self, request_id: str, prompt: str | None, req: Request, stream: bool) -> RequestState:
        st = RequestState(request_id, prompt, stream)
        if req.params.prompt_logprobs is not None:
            st.prompt_logprobs = [None]
        self.add_seq(st, req)
        return st

    def add_seq(self, st: RequestState, req: Request) -> None:
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens) \
            if (st.stream or p.stop) and p.detokenize else None
        hold = max(len(s) for s in p.stop) - 1 if p.stop else 0
        st.seqs.append(SeqOutput(req, detok, hold, logprobs=[] if p.logprobs is not None else None))

    def observe(self, st: RequestState, u: SeqUpdate, smp) -> None:
        """Logprobs, text and stop strings for one new token (the scheduler has appended it)."""
        req, tok, p = u.request, u.token_id, st.params
        seq = st.seqs[req.seq_index]
        if req.seq_index == 0 and req.num_output_tokens == 1:
            self.counters.prompt_tokens += req.num_prompt_tokens
        self.counters.generation_tokens += 1
        if smp.logprobs is not None:
            seq.logprobs.append(smp.logprobs)
            seq.cum_logprob += smp.logprobs[tok].logprob
        if seq.detok is not None:
            delta = seq.detok.add(tok)
            seq.add_text(delta)
            if p.stop and delta and req.num_output_tokens >= p.min_tokens:
                self._check_stop_strings(seq, len(delta))
        if req.status.finished:
            self.counters.count_finish(seq.finish_reason())
            if seq.detok is not None and req.status is RequestStatus.FINISHED_LENGTH and seq.stop is None:
                seq.add_text(seq.detok.flush())
            if seq.detok is None and p.detokenize:
                seq.add_text(self.tokenizer.decode(req.output_token_ids, skip_special_tokens=p.skip_special_tokens))
        seq.settle()

    def _check_stop_strings(self, seq: SeqOutput, delta_len: int) -> None:
        """A stop string in the text ends the sequence: the text is cut here and the finish reason is
        this processor's ("stop", the string); the core is asked to end the sequence unless the same
        token already ended it (by length or EOS), whose label stays the core's own."""
        text, p = seq.pending, seq.request.params
        for stop in p.stop:
            k = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
            if k >= 0:
                seq.pending = text[: k + len(stop)] if p.include_stop_str_in_output else text[:k]
                seq.stop = stop
                if not seq.request.status.finished:
                    self.scheduler.finish(seq.request, RequestStatus.FINISHED_STOPPED)
                return

    def output(self, st: RequestState) -> RequestOutput:
        """Deltas for a stream (and marks them handed out); the whole output otherwise."""
        finished = st.finished
        if finished:            # an abort or a failure ends sequences between tokens: release held text
            for seq in st.seqs:
                seq.settle()
        outs = []
        for i, seq in enumerate(st.seqs):
            r = seq.request
            if st.stream:
                text, start = "".join(seq.parts), seq.sent_tokens
                seq.parts.clear()
                seq.sent_tokens = r.num_output_tokens
            else:
                text, start = "".join(seq.parts), 0
            outs.append(CompletionOutput(i, text, r.output_token_ids[start:],
                                         seq.cum_logprob if seq.logprobs is not None else None,
                                         None if seq.logprobs is None else seq.logprobs[start:],
                                         seq.finish_reason(), seq.stop if seq.stop is not None else r.stop_reason))
        r0 = st.seqs[0].request
        plp = None
        if st.prompt_logprobs is not None and not st.prompt_logprobs_sent and (
                finished or (st.stream and len(st.prompt_logprobs) == r0.num_prompt_tokens)):
            plp, st.prompt_logprobs_sent = st.prompt_logprobs, True
        m = RequestMetrics(r0.arrival_time, r0.first_scheduled_time, r0.first_token_time, r0.last_token_time,
                           time.monotonic() if finished else None, sum(s.request.num_preemptions for s in st.seqs),
                           r0.traffic_class)
        return RequestOutput(st.request_id, st.prompt, r0.prompt_token_ids, outs, finished,
                             max(0, r0.num_cached_tokens), m, st.error, plp, st.embedding if finished else None)
