"""The ITL floor at start-up (issue 54): from this host's cached step-time calibration, a traffic class
whose itl_p99_ms is under the floor is accepted with a warning naming the class, the field and the floor,
or refused with strict_slo; above it the engine starts quietly. The calibration is a FittedCost written
where the engine is told to look for it (a temporary file), so the floor is exact. Without one, a probe at
start-up fits the model."""
import json
import logging

import pytest

from pagedserve.config import EngineArgs
from pagedserve.sim.cost_model import FIT_TERMS, FittedCost

FLAT_S = 0.1      # a step-time model of 100 ms a step whatever it carries: the floor is 100 / 0.8 = 125 ms


def classes(itl_ms):
    return json.dumps([{"name": "interactive", "priority": 0, "itl_p99_ms": itl_ms}, {"name": "batch", "priority": 10}])


@pytest.fixture()
def calibrated(tmp_path, monkeypatch):
    path = str(tmp_path / "calibration.json")
    FittedCost({k: (FLAT_S if k == "fixed" else 0.0) for k in FIT_TERMS}).save(path)
    monkeypatch.setattr("pagedserve.engine.core.cache_path", lambda args: path)
    return lambda **kw: EngineArgs(max_model_len=512, num_kv_blocks=64, **kw)


def test_a_target_under_the_floor_warns_naming_it_and_strict_slo_refuses(calibrated, caplog):
    from pagedserve import LLMEngine
    with pytest.raises(ValueError) as e:
        LLMEngine(calibrated(traffic_classes=classes(100), strict_slo=True))
    msg = str(e.value)
    assert msg.startswith("strict_slo:") and "'interactive'" in msg and "itl_p99_ms 100" in msg and "125.0 ms" in msg
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        eng = LLMEngine(calibrated(traffic_classes=classes(100)))
    assert eng.core.startup_itl_floor_ms == pytest.approx(125.0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'interactive'" in w and "itl_p99_ms 100" in w and "125.0 ms" in w for w in warned), warned
    assert any("ITL floor 125.0 ms" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        LLMEngine(calibrated(traffic_classes=classes(130), strict_slo=True))    # over the floor: starts, no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "floor" in r.getMessage()]


def test_strict_slo_without_any_step_time_model_is_refused_naming_the_way_to_make_one(tmp_path, monkeypatch):
    from pagedserve import LLMEngine
    monkeypatch.setattr("pagedserve.engine.core.cache_path", lambda args: str(tmp_path / "none.json"))
    monkeypatch.setattr("pagedserve.engine.core.probe_step_times", lambda *a, **k: [])   # (a pool too small for it)
    with pytest.raises(ValueError, match=r"strict_slo: no step-time model .*pagedserve simulate --calibrate"):
        LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=64, traffic_classes=classes(100), strict_slo=True))


def test_without_a_calibration_a_probe_at_start_up_fits_the_model_and_leaves_nothing_behind(tmp_path, monkeypatch,
                                                                                             caplog):
    """No calibration cached: the engine times probe steps at load (sim.probe.probe_step_times) and fits the
    live model on them, so the floor is known before the first request (strict_slo judges a target against it)
    and the first steps are planned by this host's times. The probe's blocks go back to the pool, the runner
    keeps no row of it, and the tokens are the engine's without classes."""
    from pagedserve import LLMEngine
    from pagedserve.sim.probe import probe_rows
    monkeypatch.setattr("pagedserve.engine.core.cache_path", lambda args: str(tmp_path / "none.json"))
    with caplog.at_level(logging.INFO, logger="pagedserve"), \
            pytest.raises(ValueError, match=r"strict_slo: traffic class 'interactive': itl_p99_ms 0\.01 is under"):
        LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=64, traffic_classes=classes(0.01), strict_slo=True))
    assert any(r.getMessage().startswith("step-time probe: 24 steps timed") for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        eng = LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=64, traffic_classes=classes(10_000)))
    core = eng.core
    assert core.step_cost.model is not None and core.step_cost.count == 2 * len(probe_rows(64, 64))
    assert core.startup_itl_floor_ms is not None and core.startup_itl_floor_ms > 0
    assert "step-time probe" in core.startup.seconds()
    # (the refused start above probed and kept its samples: this one reads them)
    assert any(r.getMessage().startswith("step-time probe: 24 steps read from the cache") for r in caplog.records)
    assert core.kv.num_free_blocks == core.kv.pool.num_usable_blocks and len(core.runner.batch) == 0
    plain = LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=64))
    assert greedy(eng) == greedy(plain)
    # the engine feeds each step's time back to the share it plans ITL-bound steps under (traffic.StepHeadroom)
    h = eng.core.scheduler.headroom
    assert h.steps > 0 and h.misses == 0 and h.value > 0.8     # (from 0.8: steps within the target raise it)
    limits = eng.scheduler_view()["limits"]
    assert limits["itl_headroom"] == round(h.value, 3) and limits["itl_steps_past_target"] == [0, h.steps]


def greedy(eng) -> dict[str, list[int]]:
    from pagedserve import SamplingParams
    for i, p in enumerate(([1, 2, 3, 4, 5, 6, 7, 8], list(range(100, 160)))):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=8, temperature=0.0))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


def test_the_probes_kept_samples_are_ignored_when_damaged_or_of_another_host_and_an_unwritable_folder_warns(
        tmp_path, monkeypatch, caplog):
    """The probe's samples file is a cache entry: a damaged one, another host's or other code's is ignored and probed
    again (and rewritten), never trusted; a folder it cannot be written to is a warning and the engine starts."""
    from pagedserve import LLMEngine
    from pagedserve.sim.probe import host_key, probe_rows
    probed = []

    def fake_probe(*a, **k):                  # steps whose time grows with their tokens and rows, as steps do
        probed.append(1)
        return [([(s, n, k) for _, s, n, k in step], 0.002 + 1e-4 * sum(n for _, _, n, _ in step) + 1e-3 * len(step))
                for step in probe_rows(64, 64) * 2]
    monkeypatch.setattr("pagedserve.engine.core.probe_step_times", fake_probe)
    calib = tmp_path / "c.json"
    monkeypatch.setattr("pagedserve.engine.core.cache_path", lambda args: str(calib))
    kept = tmp_path / "c.probe.json"

    def start():
        eng = LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=64, traffic_classes=classes(10_000)))
        assert eng.core.step_cost.model is not None and eng.core.step_cost.count == 24
        return eng
    start()
    assert len(probed) == 1 and json.loads(kept.read_text())["host"] == host_key()
    start()
    assert len(probed) == 1                                                   # read, not probed
    good = json.loads(kept.read_text())
    for damage in ('{"host": "', json.dumps(good | {"samples": [[[[0, -5, 1]], 0.1]]}), json.dumps(good | {"host": "AMD"}),
                   json.dumps(good | {"code": "older code"})):
        kept.write_text(damage)
        with caplog.at_level(logging.WARNING, logger="pagedserve"):
            start()
        assert json.loads(kept.read_text())["host"] == host_key()             # probed again and rewritten
    assert len(probed) == 5
    assert sum("ignoring its cached samples" in r.getMessage() for r in caplog.records) == 2   # (another host, code: quiet)
    caplog.clear()
    calib = tmp_path / "no-such-folder" / "c.json"
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        start()
    assert any("could not keep its samples" in r.getMessage() for r in caplog.records) and len(probed) == 6
