"""The ITL floor at start-up (issue 54): from this host's cached step-time calibration, a traffic class
whose itl_p99_ms is under the floor is accepted with a warning naming the class, the field and the floor,
or refused with strict_slo; above it the engine starts quietly. The calibration is a FittedCost written
where the engine is told to look for it (a temporary file), so the floor is exact."""
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


def test_strict_slo_without_a_calibration_is_refused_naming_the_way_to_make_one(tmp_path, monkeypatch):
    from pagedserve import LLMEngine
    monkeypatch.setattr("pagedserve.engine.core.cache_path", lambda args: str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match=r"strict_slo: no step-time model .*pagedserve simulate --calibrate"):
        LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=64, traffic_classes=classes(100), strict_slo=True))
