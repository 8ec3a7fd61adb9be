"""StepOutput's codec: the one message the engine core sends every step, as msgpack arrays of plain values
(no objects named, nothing to allow-list; the records are rebuilt on the frontend's side). Layout, one array:

    [tokens, prompt_logprobs, embeddings, failed, error, stats]
    tokens:          [[seq_id, owner_id, seq_index, token_id, logprobs, finish, stop_reason, times], ...]
    logprobs:        None | {token id: [logprob, rank, decoded]}
    times:           [first_scheduled, first_token, last_token, num_preemptions, num_cached_tokens]
    prompt_logprobs: {request id: [None | logprobs, ...]}
    embeddings:      {request id: [float, ...]}
    error:           None | [kind, message]
    stats:           StepStats' fields in their order, rows as [[start, tokens, samples], ...]

Why msgpack and not the allow-listed pickle of the other messages: bench/wire_codec.py."""
from __future__ import annotations

from dataclasses import fields

import msgpack

from pagedserve.engine.outputs import EngineCoreOutputs, RequestFailure, SeqTimes, SeqToken, StepStats
from pagedserve.core.step import Logprob

_STATS = tuple(f.name for f in fields(StepStats))


def _lps_out(lps: dict[int, Logprob] | None):
    return None if lps is None else {t: [lp.logprob, lp.rank, lp.decoded_token] for t, lp in lps.items()}


def _lps_in(lps) -> dict[int, Logprob] | None:
    return None if lps is None else {t: Logprob(*v) for t, v in lps.items()}


def encode_step(out: EngineCoreOutputs, stats: StepStats) -> bytes:
    tokens = [[t.seq_id, t.owner_id, t.seq_index, t.token_id, _lps_out(t.logprobs), t.finish, t.stop_reason,
               [t.times.first_scheduled_time, t.times.first_token_time, t.times.last_token_time,
                t.times.num_preemptions, t.times.num_cached_tokens]] for t in out.tokens]
    plps = {rid: [_lps_out(d) for d in lps] for rid, lps in out.prompt_logprobs.items()}
    err = None if out.error is None else [out.error.kind, out.error.message]
    st = [getattr(stats, n) for n in _STATS]
    return msgpack.packb([tokens, plps, out.embeddings, list(out.failed), err, st], use_bin_type=True)


def decode_step(data: bytes) -> tuple[EngineCoreOutputs, StepStats]:
    """The step's outputs and stats from encode_step's bytes; ValueError naming `data` for anything else."""
    try:
        tokens, plps, embeddings, failed, err, st = msgpack.unpackb(data, strict_map_key=False, use_list=True)
        out = EngineCoreOutputs(
            [SeqToken(sid, owner, idx, tok, _lps_in(lps), fin, reason, SeqTimes(*times))
             for sid, owner, idx, tok, lps, fin, reason, times in tokens],
            {rid: [_lps_in(d) for d in lps] for rid, lps in plps.items()}, embeddings, tuple(failed),
            None if err is None else RequestFailure(*err))
        values = dict(zip(_STATS, st, strict=True))
        values["rows"] = tuple(tuple(r) for r in values["rows"])
        return out, StepStats(**values)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise ValueError(f"data: not a StepOutput of the engine core's protocol ({type(e).__name__}: {e})") from e
