"""Faults stay local: a step that fails ends only the requests it ran, with an error (never
"abort"), frees their blocks, and the engine goes on serving the others."""
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.core.request import RequestStatus
from pagedserve.engine.outputs import RequestFailure
from pagedserve.errors import EngineDeadError


@pytest.fixture()
def engine():
    # float32: the tests compare a request's tokens in a batch of two with its tokens alone, which only
    # float32 promises (bfloat16's products differ by batch shape: 10 prefill rows dense, 5 packed)
    return LLM(num_kv_blocks=200, max_num_seqs=2, dtype="float32").engine


def _run(eng, limit=500):
    done = {}
    for _ in range(limit):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_failed_step_fails_only_its_requests(engine, monkeypatch):
    eng = engine
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    for rid in ("a", "b", "c"):
        eng.add_request(rid, [1, 2, 3, 4, 5], sp)
    real = eng.core.runner.execute
    calls = {"n": 0}

    def flaky(so):
        calls["n"] += 1
        if calls["n"] == 3:                       # a and b are running (max_num_seqs=2), c waits
            assert {s.request_id for s in so.seqs} == {"a", "b"}
            raise RuntimeError("injected fault")
        return real(so)
    monkeypatch.setattr(eng.core.runner, "execute", flaky)
    done = _run(eng)
    assert done["a"].error == done["b"].error
    assert done["a"].error.kind == "internal_error" and "injected fault" in done["a"].error.message
    assert [o.finish_reason for o in done["a"].outputs] == ["error"]
    assert done["c"].error is None and done["c"].outputs[0].finish_reason == "length"
    assert len(done["c"].outputs[0].token_ids) == 6
    assert eng.counters.finished.get("error") == 2 and "abort" not in eng.counters.finished
    assert all(b.ref_cnt == 0 for b in eng.core.kv.pool.blocks[1:]) and not eng.core.scheduler.requests
    # and the engine serves the next request as if nothing happened
    eng.add_request("d", [1, 2, 3, 4, 5], sp)
    assert _run(eng)["d"].outputs[0].token_ids == done["c"].outputs[0].token_ids


def test_fault_in_a_forked_request_fails_all_its_samples(engine, monkeypatch):
    eng = engine
    eng.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    eng.step()
    eng.step()
    monkeypatch.setattr(eng.core.runner, "execute", lambda so: (_ for _ in ()).throw(ValueError("bad kernel")))
    out = eng.step()[0]
    assert out.finished and out.error.kind == "internal_error"
    assert [o.finish_reason for o in out.outputs] == ["error", "error"]
    assert all(b.ref_cnt == 0 for b in eng.core.kv.pool.blocks[1:])


def test_scheduler_fault_is_engine_death(engine, monkeypatch):
    eng = engine
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    monkeypatch.setattr(eng.core.scheduler, "schedule", lambda: 1 / 0)
    with pytest.raises(EngineDeadError, match="scheduler failed"):
        eng.step()


def test_fail_request_and_abort_are_distinct(engine):
    eng = engine
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    failed = eng.fail_request("a", RequestFailure("timeout", "too slow"))
    aborted = eng.abort("b")
    assert failed.finished and failed.error.kind == "timeout" and failed.outputs[0].finish_reason == "error"
    assert aborted.finished and aborted.error is None and aborted.outputs[0].finish_reason == "abort"
    assert eng.fail_request("a", RequestFailure("timeout", "again")) is None
    assert eng.has_unfinished_requests() and eng.held()["scheduler.finished_ids"] == 2   # a step tells the runner
    assert eng.step() == [] and eng.core.counters.steps == 1                  # ... and is not counted as a step
    assert not eng.has_unfinished_requests() and not any(eng.held().values())
    assert eng.core.scheduler.requests == {} and RequestStatus.FINISHED_ERROR.finished


@pytest.mark.parametrize("where", ["observe", "output"])
def test_a_fault_making_one_requests_output_fails_it_alone(engine, monkeypatch, where):
    """The frontend's side of a step (detokenizing, stop strings, the output itself) failing for one request
    fails that request alone, with an error, its blocks freed; the request beside it in the same steps
    finishes whole, and the engine serves on. With `output` failing every time for it, the failure is still
    reported (an output with the error and no sequences)."""
    eng = engine
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    eng.add_request("bad", [1, 2, 3, 4, 5], sp)
    eng.add_request("good", [1, 2, 3, 4, 5], sp)
    real = getattr(eng.outputs, where)

    def faulty(st, *a):
        if st.request_id == "bad" and (where == "output" or len(st.seqs[0].token_ids) == 2):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(st, *a)
    monkeypatch.setattr(eng.outputs, where, faulty)
    done = _run(eng)
    assert done["bad"].error.kind == "internal_error" and "injected" in done["bad"].error.message
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 6
    assert eng.counters.finished.get("error") == 1
    assert all(b.ref_cnt == 0 for b in eng.core.kv.pool.blocks[1:]) and all(v == 0 for v in eng.held().values())
    monkeypatch.undo()
    eng.add_request("next", [1, 2, 3, 4, 5], sp)
    assert _run(eng)["next"].outputs[0].token_ids == done["good"].outputs[0].token_ids
