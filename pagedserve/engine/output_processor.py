"""What users see of a request: text (incremental detokenization), stop strings, logprobs, and
`RequestOutput`s, made from the core's token ids alone (EngineCore's SeqTokens). A streaming request
gets deltas after every step (only the new tokens, text and logprobs: O(1) per step however long the
generation); any other request gets one full output when it finishes. Forks, appends and the other
finish checks belong to the core's scheduler; a stop string found here ends the sequence in the core
(LLMEngine asks it), and any tokens the core applied after it in the same step are dropped."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.outputs import (CompletionOutput, RequestFailure, RequestMetrics, RequestOutput, SeqTimes,
                                       SeqToken)
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import IncrementalDetokenizer


@dataclass(slots=True, eq=False)
class SeqOutput:
    """One sequence's tokens, text and logprobs. Text is kept as settled parts plus a short pending
    tail that a stop string could still cut; a stream hands its settled parts out (and drops them)
    after every step."""

    seq_id: str
    detok: IncrementalDetokenizer | None
    hold: int                                   # pending characters kept back (longest stop string - 1)
    token_ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    pending: str = ""
    logprobs: list | None = None
    cum_logprob: float = 0.0
    sent_tokens: int = 0                        # tokens already handed out (streams)
    finish: str | None = None                   # what the client sees: "stop" | "length" | "abort" | "error"
    stop: str | None = None                     # the stop string found in its text (finish "stop")
    stop_reason: int | None = None              # the stop token that ended it (the core's)
    times: SeqTimes = SeqTimes()

    def settle(self) -> None:
        """Move all pending text but the held-back tail (all of it once finished) into parts."""
        keep = 0 if self.finish is not None else self.hold
        if len(self.pending) > keep:
            cut = len(self.pending) - keep
            self.parts.append(self.pending[:cut])
            self.pending = self.pending[cut:]


@dataclass(slots=True, eq=False)
class RequestState:
    """The frontend's view of one user request: what it asked and its n sequences' outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool                                # deltas after every step, else one output at the end
    num_samples: int
    arrival_time: float
    traffic_class: int = 0
    sink: Any = None                            # where a frontend delivers its outputs (a RequestStream)
    seqs: list[SeqOutput] = field(default_factory=list)
    error: RequestFailure | None = None
    prompt_logprobs: list | None = None         # [None, {...}, ...] as the prompt's chunks are computed
    prompt_logprobs_sent: bool = False
    embedding: list[float] | None = None        # the pooled vector (the core's), once its prompt is done

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if self.error is not None or seqs[0].finish == "abort":
            return True
        if len(seqs) != self.num_samples:
            return False
        for s in seqs:                  # (a loop, not all() over a generator: asked twice a request a step)
            if s.finish is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, counters):
        self.tokenizer = tokenizer
        self.counters = counters

    def new_state(self, st: RequestState) -> RequestState:
        if st.params.prompt_logprobs is not None:
            st.prompt_logprobs = [None]
        self._add_seq(st, st.request_id)
        return st

    def _add_seq(self, st: RequestState, seq_id: str) -> SeqOutput:
        p = st.params
        detok = IncrementalDetokenizer(self.tokenizer, st.prompt_token_ids, p.skip_special_tokens) \
            if (st.stream or p.stop) and p.detokenize else None
        hold = max(len(s) for s in p.stop) - 1 if p.stop else 0
        seq = SeqOutput(seq_id, detok, hold, logprobs=[] if p.logprobs is not None else None)
        st.seqs.append(seq)
        return seq

    def observe(self, st: RequestState, t: SeqToken) -> bool:
        """Logprobs, text and stop strings for one new token. True when a stop string ended the sequence
        at this token while the core still runs it (the caller ends it there)."""
        p = st.params
        seq = st.seqs[t.seq_index] if t.seq_index < len(st.seqs) else self._add_seq(st, t.seq_id)  # forks: in order
        if seq.finish is not None:              # after a stop string in the same speculative run: dropped
            return False
        seq.token_ids.append(t.token_id)
        seq.times = t.times
        if t.seq_index == 0 and len(seq.token_ids) == 1:
            self.counters.prompt_tokens += len(st.prompt_token_ids)
        self.counters.generation_tokens += 1
        if t.logprobs is not None and seq.logprobs is not None:
            seq.logprobs.append(t.logprobs)
            seq.cum_logprob += t.logprobs[t.token_id].logprob
        stopped = False
        if seq.detok is not None:
            delta = seq.detok.add(t.token_id)
            seq.pending += delta
            if p.stop and delta and len(seq.token_ids) >= p.min_tokens:
                stopped = self._check_stop_strings(seq, p, len(delta))
        if seq.finish is None and t.finish is not None:
            seq.finish, seq.stop_reason = t.finish, t.stop_reason
        if seq.finish is not None:
            self.counters.count_finish(seq.finish)
            if seq.detok is not None and seq.finish == "length" and seq.stop is None:
                seq.pending += seq.detok.flush()
            if seq.detok is None and p.detokenize:
                seq.pending += self.tokenizer.decode(seq.token_ids, skip_special_tokens=p.skip_special_tokens)
        seq.settle()
        return stopped and t.finish is None

    @staticmethod
    def _check_stop_strings(seq: SeqOutput, p: SamplingParams, delta_len: int) -> bool:
        """A stop string in the text ends the sequence: the text is cut here, finish "stop" with the string
        as its stop reason (also when the same token ended it by length or EOS in the core)."""
        text = seq.pending
        for stop in p.stop:
            k = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
            if k >= 0:
                seq.pending = text[: k + len(stop)] if p.include_stop_str_in_output else text[:k]
                seq.stop, seq.finish = stop, "stop"
                return True
        return False

    def end(self, st: RequestState, finish: str) -> None:
        """An abort or a failure: every sequence not yet finished ends with `finish`, counted once each."""
        for seq in st.seqs:
            if seq.finish is None:
                seq.finish = finish
        self.counters.count_finish(finish)

    def output(self, st: RequestState) -> RequestOutput:
        """Deltas for a stream (and marks them handed out); the whole output otherwise."""
        finished = st.finished
        if finished:            # an abort or a failure ends sequences between tokens: release held text
            for seq in st.seqs:
                seq.settle()
        outs = []
        for i, seq in enumerate(st.seqs):
            text, start = "".join(seq.parts), seq.sent_tokens if st.stream else 0
            if st.stream:
                seq.parts.clear()
                seq.sent_tokens = len(seq.token_ids)
            outs.append(CompletionOutput(i, text, seq.token_ids[start:],
                                         seq.cum_logprob if seq.logprobs is not None else None,
                                         None if seq.logprobs is None else seq.logprobs[start:],
                                         seq.finish, seq.stop if seq.stop is not None else seq.stop_reason))
        plp = None
        if st.prompt_logprobs is not None and not st.prompt_logprobs_sent and (
                finished or (st.stream and len(st.prompt_logprobs) == len(st.prompt_token_ids))):
            plp, st.prompt_logprobs_sent = st.prompt_logprobs, True
        t = st.seqs[0].times
        preemptions = t.num_preemptions if len(st.seqs) == 1 else sum(s.times.num_preemptions for s in st.seqs)
        m = RequestMetrics(st.arrival_time, t.first_scheduled_time, t.first_token_time, t.last_token_time,
                           time.monotonic() if finished else None, preemptions, st.traffic_class)
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, outs, finished, t.num_cached_tokens, m,
                             st.error, plp, st.embedding if finished else None)
