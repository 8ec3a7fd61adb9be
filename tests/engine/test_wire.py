"""The engine core's protocol (engine/wire.py): every field of every message survives encode / decode, a
core Request goes through AddRequest and back, and decode refuses bytes that name anything else; the msgpack
step codec round-trips any step hypothesis makes (None logprobs and times, empty maps, big ids)."""
import dataclasses
import os
import pickle

import pytest
from hypothesis import given, settings, strategies as st

from pagedserve.core.request import Request
from pagedserve.engine.outputs import EngineCoreOutputs, RequestFailure, SeqTimes, SeqToken, StepStats
from pagedserve.engine.wire import (AddRequest, Call, CheckFits, CoreDied, CoreError, FinishRequests, GetStats, GetView,
                                    Heartbeat, LoadLora, Precompile, Ready, Reply, Shutdown, StepOutput, UnloadLora,
                                    decode, encode)
from pagedserve.engine.startup import Phase
from pagedserve.errors import EngineDeadError, ParamError, QueueFullError
from pagedserve.lora_request import LoRARequest
from pagedserve.runner.sampler import Logprob
from pagedserve.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams


def _params() -> SamplingParams:
    return SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, presence_penalty=0.5,
                          frequency_penalty=0.25, repetition_penalty=1.1, stop=["\n\n"], stop_token_ids=[9],
                          include_stop_str_in_output=True, max_tokens=33, logprobs=3,
                          prompt_logprobs=1, logit_bias={5: -2.5}, skip_special_tokens=False,
                          structured_outputs=StructuredOutputsParams(json={"type": "object"}))


def _token(i: int) -> SeqToken:
    return SeqToken(f"r#{i}", "r", i, 100 + i, {100 + i: Logprob(-0.5, 1, "x"), 7: Logprob(-1.5, 2, "y")},
                    "stop", 2, SeqTimes(1.0, 2.0, 3.0 + i, 1, 16))


def _step() -> StepOutput:
    stats = StepStats(**{f.name: (((0, 5, 1), (5, 1, 2)) if f.name == "rows" else
                                  0.25 if f.type == "float" else 3) for f in dataclasses.fields(StepStats)})
    outs = EngineCoreOutputs([_token(0), _token(1)], {"r": [None, {4: Logprob(-0.1, 1, "a")}]}, {"e": [0.5, -0.5]},
                             ("f",), RequestFailure("internal_error", "the step failed"))
    return StepOutput(outs, stats)


def _add() -> AddRequest:
    return AddRequest("r", (1, 2, 3), _params(), 33, (2, 0), -1, 1, 2, 12.5, 99, 3, PoolingParams("MEAN", True, 8),
                      LoRARequest("sql", 2, "/a"))


def _records(msg):
    """msg and every dataclass record inside it (lists, tuples and dict values walked)."""
    if dataclasses.is_dataclass(msg):
        yield msg
        for f in dataclasses.fields(msg):
            yield from _records(getattr(msg, f.name))
    elif isinstance(msg, (list, tuple)):
        for x in msg:
            yield from _records(x)
    elif isinstance(msg, dict):
        for x in msg.values():
            yield from _records(x)


MESSAGES = {"add": _add(), "finish": FinishRequests(("r", "r#1"), "abort"), "step": _step(),
            "stats": Call(4, GetStats(True)), "view": Call(5, GetView("cache")), "fits": Call(6, CheckFits(9, 8)),
            "precompile": Call(7, Precompile(_params())), "load": Call(8, LoadLora("a", "/p")),
            "unload": Call(9, UnloadLora("a")), "reply": Reply(3, {"x": [1]}, CoreError("ParamError", "m", "p", "c")),
            "died": CoreDied("gone"), "ready": Ready(None, (Phase("load", 1.5, 2.5),), "ValueError: no")}


@pytest.mark.parametrize("msg", list(MESSAGES.values()), ids=list(MESSAGES))
def test_every_field_of_every_message_survives_the_round_trip(msg):
    records = list(_records(msg))
    for rec in records:          # each field is set away from its default, so a field that is lost shows
        for f in dataclasses.fields(rec):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if default is not dataclasses.MISSING and type(rec) not in (SamplingParams, StructuredOutputsParams) \
                    and (type(rec), f.name) != (AddRequest, "mm_features"):      # (images: in process only)
                assert getattr(rec, f.name) != default, f"{type(rec).__name__}.{f.name} left at its default"
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)
    for a, b in zip(records, _records(back), strict=True):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert getattr(b, f.name) == getattr(a, f.name), f"{type(a).__name__}.{f.name}"
    if isinstance(msg, StepOutput):      # int keys stay ints, tuples stay tuples
        assert list(back.outputs.tokens[0].logprobs) == [100, 7]
        assert back.stats.rows == ((0, 5, 1), (5, 1, 2)) and back.outputs.failed == ("f",)


def test_a_request_goes_through_add_request_and_back():
    req = Request("r", [1, 2, 3], _params(), 33, (2,), priority=-1, traffic_class=1, arrival_time=12.5,
                  num_samples=2, generator_seed=99, lora_id=3)
    req.pooling = PoolingParams("MEAN")
    back = decode(encode(AddRequest.of(req))).request()
    for name in ("request_id", "prompt_token_ids", "params", "max_tokens", "eos_token_ids", "priority",
                 "traffic_class", "arrival_time", "num_samples", "generator_seed", "lora_id", "pooling",
                 "all_token_ids"):
        assert getattr(back, name) == getattr(req, name), name
    assert back is not req and back.num_computed_tokens == 0 and not back.output_token_ids
    req.mm_features = ("an image",)
    assert AddRequest.of(req).request().mm_features == ("an image",)       # in process: handed over as is
    with pytest.raises(ValueError, match="mm_features"):
        encode(AddRequest.of(req))


def test_decode_refuses_bytes_that_name_anything_else():
    """(pickled: only the protocol's classes; the allow-list is what stands between a peer's bytes and a call)"""
    with pytest.raises(ValueError, match="data: posix.system is not a message"):
        decode(pickle.dumps(os.system))
    with pytest.raises(ValueError, match="data: a dict is not a message"):
        decode(pickle.dumps({"tokens": []}))


def test_messages_without_fields_and_errors_come_back():
    for msg in (Heartbeat(), Shutdown()):
        assert decode(encode(msg)) == msg
    for e in (ParamError("max_tokens", "too many", "context_length_exceeded"), QueueFullError("full"),
              ValueError("bad"), EngineDeadError("gone")):
        back = decode(encode(Reply(1, None, CoreError.of(e)))).error.exception()
        assert type(back) is type(e) and str(back) == str(e)
        if isinstance(e, ParamError):
            assert (back.param, back.code) == (e.param, e.code)
    other = CoreError.of(KeyError("k")).exception()     # a bug in the core: it cannot go on answering
    assert type(other) is EngineDeadError and "KeyError" in str(other)


def test_the_engine_info_and_core_stats_cross(llm):
    info, stats = llm.engine.info, llm.engine.stats(shared=True)
    assert decode(encode(Ready(info, tuple(llm.engine.startup.phases)))).info == info
    assert decode(encode(Reply(1, stats))).value == stats


def test_step_output_is_msgpack_and_garbage_is_refused():
    data = encode(_step())
    assert data[:1] != b"\x80"             # not a pickle: nothing in it names a class
    with pytest.raises(ValueError, match="data: not a StepOutput"):
        decode(b"\x93\x01\x02\x03")


_ids = st.text(min_size=1, max_size=8)
_lps = st.none() | st.dictionaries(st.integers(0, 2**31), st.builds(
    Logprob, st.floats(allow_nan=False), st.integers(1, 50), st.none() | st.text(max_size=4)), max_size=3)
_times = st.builds(SeqTimes, *[st.none() | st.floats(0, 1e6)] * 3, st.integers(0, 9), st.integers(0, 999))
_tokens = st.builds(SeqToken, _ids, _ids, st.integers(0, 7), st.integers(0, 2**31), _lps,
                    st.sampled_from([None, "stop", "length"]), st.none() | st.integers(0, 2**31), _times)
_stats = st.builds(StepStats, **{f.name: st.tuples(st.integers(0, 9), st.integers(1, 9), st.integers(0, 4)).map(
    lambda r: (r,)) if f.name == "rows" else st.floats(0, 10) if f.type == "float" else st.integers(0, 10**6)
    for f in dataclasses.fields(StepStats)})
_outs = st.builds(EngineCoreOutputs, st.lists(_tokens, max_size=6),
                  st.dictionaries(_ids, st.lists(_lps, max_size=3), max_size=2),
                  st.dictionaries(_ids, st.lists(st.floats(allow_nan=False), max_size=4), max_size=2),
                  st.lists(_ids, max_size=3).map(tuple),
                  st.none() | st.builds(RequestFailure, st.sampled_from(["internal_error", "timeout"]), st.text()))


@settings(max_examples=200, deadline=None)
@given(_outs, _stats)
def test_the_msgpack_step_codec_round_trips_any_step(outs, stats):
    msg = StepOutput(outs, stats)
    data = encode(msg)
    assert data[:1] != b"\x80" and decode(data) == msg
