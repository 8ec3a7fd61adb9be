"""Traffic classes (--traffic-classes): the config's refusals, how a request finds its class, and the
scheduler's class rules (preemption of lower classes, the minimum share, max_running, budget shares,
per-class queues, the prefill cut under an ITL target). No model: the scheduler and a fake runner."""
import json

import pytest

from pagedserve.config import EngineArgs
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import MIN_PREFILL_CHUNK, QueueFullError, Scheduler, SchedulerConfig
from pagedserve.core.traffic import ITL_HEADROOM, TrafficClasses
from pagedserve.errors import ParamError
from pagedserve.sampling_params import SamplingParams

TWO = [{"name": "interactive", "priority": 0, "ttft_p99_ms": 1000, "itl_p99_ms": 150},
       {"name": "batch", "priority": 10}]


def mk(rid, n, klass, max_tokens=8, samples=1):
    r = Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, n=samples),
                max_tokens=max_tokens, num_samples=samples)
    r.traffic_class = klass
    return r


def sched(classes, num_blocks=64, bs=4, step_cost=None, **kw):
    return Scheduler(SchedulerConfig(**kw), KVCacheManager(num_blocks, bs, False, 32),   # 32 host blocks (swap)
                     classes=TrafficClasses.parse(classes), step_cost=step_cost)


class Cost:
    """A step-time model a test changes mid-run (as the engine's LiveCost is refitted while it serves)."""

    def __init__(self, f):
        self.f = f

    def __call__(self, rows):
        return self.f(rows)


def step(s):
    so = s.schedule()
    s_out = {q.request_id: [5] * q.sampling.num_samples for q in so.seqs if q.sampling is not None}
    list(s.update_from_output(so, s_out))
    return so


# ------------------------------------------------------------------ the config
@pytest.mark.parametrize("value, named", [
    ('[{"name": "a"}]', "traffic_classes[0].priority is required"),
    ('[{"priority": 1}]', "traffic_classes[0].name is required"),
    ('[{"name": "a", "priority": 0, "latency": 5}]', "traffic_classes[0].latency: unknown key"),
    ('[{"name": "a", "priority": 0, "max_running": -1}]', "traffic_classes[0] (a).max_running"),
    ('[{"name": "a", "priority": 0, "max_waiting": -2}]', "traffic_classes[0] (a).max_waiting"),
    ('[{"name": "a", "priority": 0, "itl_p99_ms": 0}]', "traffic_classes[0] (a).itl_p99_ms"),
    ('[{"name": "a", "priority": 0, "max_budget_share": 1.5}]', "traffic_classes[0] (a).max_budget_share"),
    ('[{"name": "a", "priority": 0, "max_budget_share": 0.7}, {"name": "b", "priority": 1, "max_budget_share": 0.4}]',
     "sum to 1.1, over 1"),
    ('[{"name": "a", "priority": 0, "preemption_mode": "drop"}]', "traffic_classes[0] (a).preemption_mode"),
    ('[{"name": "a", "priority": 0}, {"name": "a", "priority": 1}]', "'a' is named twice"),
    ('[{"name": "a", "priority": 0}, {"name": "b", "priority": 0}]', "another class's priority"),
    ('[{"name": "a", "priority": "high"}]', "priority must be an integer"),
    ("[]", "non-empty JSON list"),
    ("{not json", "must be a JSON list"),
])
def test_a_bad_class_list_is_refused_at_start_naming_the_key(value, named):
    with pytest.raises(ValueError) as e:
        EngineArgs(traffic_classes=value)
    assert named in str(e.value)


def test_classes_come_from_a_file_or_json_and_are_ranked_by_priority(tmp_path):
    path = tmp_path / "classes.json"
    path.write_text(json.dumps(list(reversed(TWO))))
    tc = TrafficClasses.parse(str(path))
    assert tc.names == ("interactive", "batch") and tc.itl_target_s == 0.15
    assert TrafficClasses.parse(json.dumps(TWO)).describe() == tc.describe()
    # priority bands: the class with the highest priority value not above the request's
    assert [tc.resolve(p) for p in (-5, 0, 3, 9, 10, 99)] == [0, 0, 0, 0, 1, 1]
    assert tc.resolve(0, "batch") == 1                  # a named class wins over the priority
    with pytest.raises(ParamError) as e:
        tc.resolve(0, "bulk")
    assert e.value.param == "traffic_class" and "'bulk'" in str(e.value) and "interactive, batch" in str(e.value)
    with pytest.raises(ValueError, match="traffic_classes"):
        EngineArgs(traffic_classes=TWO, scheduling_policy="static")


# ------------------------------------------------------------------ scheduling
def test_a_higher_class_takes_a_slot_from_a_lower_one_and_the_victim_keeps_its_place():
    s = sched(TWO, max_num_seqs=3)
    for i in range(3):
        s.add_request(mk(f"b{i}", 4, 1))
    step(s)
    assert [r.request_id for r in s.running] == ["b0", "b1", "b2"]
    s.add_request(mk("i0", 4, 0))
    so = step(s)
    assert so.preempted == ("b2",)                      # lowest class, most recently admitted
    assert [r.request_id for r in s.running][:1] == ["i0"] and "b2" not in {r.request_id for r in s.running}
    s.add_request(mk("b3", 4, 1))                        # arrives after b2 was preempted
    assert [r.request_id for _, r in sorted(s.waiting, key=lambda e: e[0])] == ["b2", "b3"]
    assert s.waiting_reason(s.requests["b2"]).startswith("traffic class batch") or \
        s.waiting_reason(s.requests["b2"]) == "max_num_seqs reached"


def test_class_preemption_never_takes_a_class_s_last_running_sequence():
    """The minimum share: a lower class keeps one running sequence, so it never starves."""
    s = sched(TWO, max_num_seqs=2)
    s.add_request(mk("b0", 4, 1, max_tokens=50))
    s.add_request(mk("b1", 4, 1, max_tokens=50))
    step(s)
    for i in range(3):
        s.add_request(mk(f"i{i}", 4, 0, max_tokens=50))
    so = step(s)
    assert so.preempted == ("b1",)
    running = [r.request_id for r in s.running]
    assert "b0" in running and running.count("b0") == 1 and len(running) == 2
    for _ in range(5):
        assert "b0" in {q.request_id for q in step(s).seqs}   # b0 decodes every step


def test_a_class_with_waiting_work_and_nothing_running_is_admitted_first():
    s = sched(TWO, max_num_seqs=2)
    s.add_request(mk("b0", 4, 1))
    for i in range(4):
        s.add_request(mk(f"i{i}", 4, 0, max_tokens=50))
    so = s.schedule()
    assert {q.request_id for q in so.seqs} == {"b0", "i0"}


def test_a_higher_class_preempts_for_blocks_in_the_victim_s_class_mode():
    classes = [{"name": "hi", "priority": 0}, {"name": "lo", "priority": 1, "preemption_mode": "swap"}]
    s = sched(classes, num_blocks=9, bs=4)              # 8 usable blocks
    s.add_request(mk("lo0", 12, 1, max_tokens=20))      # 4 blocks each at first
    s.add_request(mk("lo1", 12, 1, max_tokens=20))
    step(s)
    s.add_request(mk("hi0", 12, 0))
    so = step(s)
    assert so.preempted == ("lo1",) and s.requests["lo1"].status is RequestStatus.SWAPPED
    assert so.block_ops.swap_out and "hi0" in {q.request_id for q in so.seqs}
    assert s.requests["lo1"].num_computed_tokens > 0    # swapped: its progress is kept


def test_max_running_holds_a_class_and_lets_the_others_run():
    classes = [{"name": "hi", "priority": 0, "max_running": 1}, {"name": "lo", "priority": 1}]
    s = sched(classes)
    s.add_request(mk("hi0", 4, 0))
    s.add_request(mk("hi1", 4, 0))
    s.add_request(mk("lo0", 4, 1))
    so = s.schedule()
    assert {q.request_id for q in so.seqs} == {"hi0", "lo0"}
    assert s.waiting_reason(s.requests["hi1"]) == "traffic class hi: max_running (1)"
    with pytest.raises(ParamError) as e:               # could never run in its class
        s.add_request(mk("hi2", 4, 0, samples=2))
    assert e.value.param == "n" and "max_running (1)" in str(e.value)


def test_a_budget_share_caps_a_class_s_tokens_per_step():
    classes = [{"name": "hi", "priority": 0}, {"name": "lo", "priority": 1, "max_budget_share": 0.25}]
    s = sched(classes, max_num_batched_tokens=64, long_prefill_token_threshold=64)
    s.add_request(mk("lo0", 60, 1))
    s.add_request(mk("hi0", 40, 0))
    so = s.schedule()
    got = {q.request_id: q.num_tokens for q in so.seqs}
    assert got == {"hi0": 40, "lo0": 16}                 # 0.25 x 64
    assert s.last_limits == {}                           # nothing held: lo0 ran (its chunk was cut)


def test_a_class_s_waiting_queue_is_bounded():
    classes = [{"name": "hi", "priority": 0, "max_waiting": 1}, {"name": "lo", "priority": 1}]
    s = sched(classes)
    s.add_request(mk("hi0", 4, 0))
    with pytest.raises(QueueFullError, match="traffic class 'hi'"):
        s.add_request(mk("hi1", 4, 0))
    s.add_request(mk("lo0", 4, 1))                       # the other class still queues


def test_an_itl_target_cuts_lower_class_prefill_to_the_predicted_step_time():
    cost = Cost(lambda rows: 0.010 + 0.0005 * sum(n for _, n, _ in rows))      # 10 ms + 0.5 ms a token
    s = sched(TWO, max_num_batched_tokens=512, long_prefill_token_threshold=512, num_blocks=256, step_cost=cost)
    s.add_request(mk("i0", 8, 0, max_tokens=100))
    step(s)                                              # i0 prefilled; it decodes from now on
    s.add_request(mk("b0", 400, 1))
    so = s.schedule()
    got = {q.request_id: q.num_tokens for q in so.seqs}
    target = 0.150 * ITL_HEADROOM
    # the largest chunk that keeps 10 ms + 0.5 ms x (1 + chunk) under the target
    assert got == {"i0": 1, "b0": int((target - 0.010) / 0.0005) - 1}
    assert s.step_cost([(8, 1, 1), (0, got["b0"], 0)]) <= target
    assert "prefill cut" in s.last_limits["batch"]
    # decodes so slow that no prefill fits: a step still takes MIN_PREFILL_CHUNK tokens of it
    cost.f = lambda rows: 1.0
    list(s.update_from_output(so, {"i0": [5]}))
    assert {q.request_id: q.num_tokens for q in s.schedule().seqs} == {"i0": 1, "b0": MIN_PREFILL_CHUNK}


def test_without_an_itl_class_decoding_prefill_is_cut_only_by_a_ttft_target():
    """An ITL target acts while its class decodes; a TTFT target bounds every step to half of it (an
    arrival waits for the step in flight, then takes its own)."""
    itl_only = [{"name": "interactive", "priority": 0, "itl_p99_ms": 150}, {"name": "batch", "priority": 10}]
    s = sched(itl_only, max_num_batched_tokens=512, long_prefill_token_threshold=512, num_blocks=256,
              step_cost=lambda rows: 1.0)
    s.add_request(mk("b0", 400, 1))
    assert {q.request_id: q.num_tokens for q in s.schedule().seqs} == {"b0": 400}
    s = sched(TWO, max_num_batched_tokens=512, long_prefill_token_threshold=512, num_blocks=256,
              step_cost=lambda rows: 0.0005 * sum(n for _, n, _ in rows))       # 0.5 ms a token
    s.add_request(mk("b0", 400, 1))                     # nothing interactive runs: 0.8 x 1000 ms / 2 bounds it,
    assert {q.request_id: q.num_tokens for q in s.schedule().seqs} == {"b0": 400}     # and 200 ms fits
    s = sched(TWO, max_num_batched_tokens=2048, long_prefill_token_threshold=2048, num_blocks=1024,
              step_cost=lambda rows: 0.0005 * sum(n for _, n, _ in rows))
    s.add_request(mk("b1", 2000, 1))
    assert {q.request_id: q.num_tokens for q in s.schedule().seqs} == {"b1": 800}   # 0.4 s at 0.5 ms a token


def test_under_an_itl_target_lower_class_decodes_take_turns():
    """Decodes of a class without a target that would push the step past the target wait for a later
    step, longest-waiting first: every batch sequence still decodes, in turn."""
    s = sched(TWO, num_blocks=256, step_cost=lambda rows: 0.020 * len(rows))   # 20 ms a row: 6 fit under 0.8 x 150 ms
    for i in range(10):
        s.add_request(mk(f"b{i}", 4, 1, max_tokens=50))
    step(s)                                              # every batch request prefilled; all decode from now
    s.add_request(mk("i0", 4, 0, max_tokens=50))
    step(s)                                              # i0 prefilled (the cap needs a decoding i0)
    seen = []
    for _ in range(4):
        so = step(s)
        ids = [q.request_id for q in so.seqs]
        assert "i0" in ids and len(ids) == 6, ids
        seen.append(set(ids) - {"i0"})
        assert s.last_limits == {"batch": "decodes deferred by the ITL target"}
    assert set().union(*seen[:2]) == {f"b{i}" for i in range(10)}   # two steps: each batch sequence once


# ------------------------------------------------------------------ the ITL floor (issue 54)
def row_cost(rows):
    """A fake step-time model, monotone in every row's context, tokens and samples: 4 ms a step, 1 ms a
    row, 0.5 ms a token, 2 us a token per context token read, 3 ms a sampled row."""
    return 0.004 + sum(0.001 + 0.0005 * n + 2e-6 * n * (s + n) + 0.003 * k for s, n, k in rows)


def test_the_floor_is_the_least_step_the_rules_guarantee_on_a_fake_cost():
    from pagedserve.core.traffic import itl_floor_s, least_step_rows, reference_floor_rows
    rows = least_step_rows([10, 20], [[100, 300], [], [50]], [0, 700, 40])
    # every targeted decode, the deepest decode of each other class with decodes, one deepest sampling chunk
    assert rows == [(10, 1, 1), (20, 1, 1), (300, 1, 1), (50, 1, 1), (700, MIN_PREFILL_CHUNK, 1)]
    assert least_step_rows([10], [[]], []) == [(10, 1, 1)]
    expected = (0.004 + 4 * (0.001 + 0.0005 + 0.003) + 2e-6 * (11 + 21 + 301 + 51)
                + 0.001 + 0.0005 * 16 + 2e-6 * 16 * 716 + 0.003) / ITL_HEADROOM
    assert itl_floor_s(row_cost, rows) == pytest.approx(expected)
    assert reference_floor_rows(1, 2048) == [(MIN_PREFILL_CHUNK, 1, 1), (2047, 1, 1), (2032, MIN_PREFILL_CHUNK, 1)]
    assert reference_floor_rows(0, 2048) == [(MIN_PREFILL_CHUNK, 1, 1)]
    # the scheduler's floor reads its own queues: i0 decoding, b0/b1 decoding, b2 mid-prompt, b3 waiting
    s = sched(TWO, num_blocks=512, max_num_batched_tokens=64, long_prefill_token_threshold=64)
    assert s.itl_floor_s() is None                     # no step-time model
    s = sched(TWO, num_blocks=512, max_num_batched_tokens=64, long_prefill_token_threshold=64, step_cost=row_cost)
    for rid, n in (("b0", 20), ("b1", 40)):
        s.add_request(mk(rid, n, 1, max_tokens=50))
    step(s)
    s.add_request(mk("i0", 8, 0, max_tokens=50))
    s.add_request(mk("b2", 200, 1, max_tokens=50))
    step(s)
    s.add_request(mk("b3", 30, 1))
    ctx = {r.request_id: r.num_computed_tokens for r in s.running}
    assert s.running[0].request_id == "i0" and 0 < ctx["b2"] < 199
    want = least_step_rows([ctx["i0"]], [[], [ctx["b0"], ctx["b1"]]], [ctx["b2"], 0])
    assert s.itl_floor_s() == pytest.approx(row_cost(want) / ITL_HEADROOM)
    by_name = {c["name"]: c for c in s.class_summary()}
    assert by_name["interactive"]["itl_floor_ms"] == round(s.itl_floor_s() * 1e3, 1)
    assert by_name["batch"]["itl_floor_ms"] is None     # a class without an ITL target has no floor


def test_a_target_under_the_floor_is_named_in_the_warning():
    tc = TrafficClasses.parse(TWO)
    assert tc.floor_warnings(149.0) == []
    (line,) = tc.floor_warnings(185.2)
    assert "'interactive'" in line and "itl_p99_ms 150" in line and "185.2 ms" in line


def test_strict_slo_needs_traffic_classes():
    with pytest.raises(ValueError, match="strict_slo"):
        EngineArgs(strict_slo=True)
    assert EngineArgs(strict_slo=True, traffic_classes=TWO).strict_slo


try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:                                     # pragma: no cover (hypothesis is a test dependency)
    raise


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_step_passes_the_target_when_the_target_is_over_the_floor(data):
    """Any workload of both classes (arrivals between steps, prompts of 2-300 tokens, 1-40 tokens out),
    under a fake monotone cost: whenever the floor (before the step) is at or under the ITL target and the
    interactive class decodes, the planned step's predicted time is under ITL_HEADROOM x the target."""
    target_ms = data.draw(st.sampled_from([15.0, 25.0, 40.0, 60.0, 150.0]), label="itl_p99_ms")
    classes = [{"name": "interactive", "priority": 0, "itl_p99_ms": target_ms}, {"name": "batch", "priority": 10}]
    s = sched(classes, num_blocks=data.draw(st.integers(64, 600), label="blocks"), bs=16,
              max_num_batched_tokens=256, long_prefill_token_threshold=data.draw(st.sampled_from([32, 128, 256])),
              max_num_seqs=data.draw(st.integers(2, 16), label="max_num_seqs"), step_cost=row_cost)
    held = 0
    for k in range(data.draw(st.integers(5, 40), label="steps")):
        for j in range(data.draw(st.integers(0, 3))):
            klass = data.draw(st.integers(0, 1))
            n = data.draw(st.integers(2, 60 if klass == 0 else 300))
            try:
                s.add_request(mk(f"{'ib'[klass]}{k}.{j}", n, klass, max_tokens=data.draw(st.integers(1, 40))))
            except (ParamError, QueueFullError):
                pass
        floor = s.itl_floor_s()
        before = [(r.request_id, r.num_computed_tokens, r.num_tokens, len(r.output_token_ids)) for r in s.running] + \
            [(r.request_id, r.num_computed_tokens, r.num_tokens, r.status.name) for _, r in s.waiting]
        decoding = any(r.traffic_class == 0 and r.output_token_ids for r in s.running)
        so = step(s)
        rows = [(q.start, q.num_tokens, q.sampling.num_samples if q.sampling else 0) for q in so.seqs]
        if decoding and floor <= target_ms / 1e3:
            held += 1
            assert row_cost(rows) <= ITL_HEADROOM * target_ms / 1e3 + 1e-12, (rows, floor, before, [q.request_id for q in so.seqs], s.last_limits)
    assert not any(r.status is RequestStatus.RUNNING and r not in s.running for r in s.requests.values())


def test_the_fed_back_share_lets_about_one_step_in_a_hundred_pass_its_target():
    """traffic.StepHeadroom: steps planned at share x target whose measured time is the plan times a noisy factor
    (a host whose steps run 0.9-1.8x their prediction, as issue 54 measured on a 2-core host) settle where about one
    in a hundred passes the target, whatever the noise's scale; the share stays in [LO, HI], and a target no step
    can meet drives it to LO, not below."""
    import random
    from pagedserve.core.traffic import StepHeadroom

    for spread in (1.2, 1.8):
        rng, h, target = random.Random(3), StepHeadroom(), 0.150
        assert h.value == ITL_HEADROOM                                  # before any step
        late = []
        for i in range(20_000):
            planned = target * h.value
            took = planned * (0.9 + (spread - 0.9) * rng.random() ** 6)   # mostly near the plan, a long tail
            h.observe(took, target)
            if i >= 10_000:
                late.append(took > target)
        assert 0.004 <= sum(late) / len(late) <= 0.02, (spread, sum(late) / len(late), h.value)
        assert StepHeadroom.LO <= h.value <= StepHeadroom.HI
    h = StepHeadroom()
    for _ in range(500):
        h.observe(1.0, 0.1)
    assert h.value == StepHeadroom.LO and h.misses == h.steps == 500


def test_late_first_tokens_shrink_the_ttft_step_share_and_prompt_chunks_with_it():
    """traffic.TtftShare, fed by the scheduler's first tokens (its clock less the request's arrival): while first
    tokens of the class with a TTFT target come past it, the share of that target a step may take shrinks (so
    does the prefill a step carries under a step-time model); first tokens in time grow it back, never past
    TTFT_STEP_SHARE; a class without a TTFT target, and a fork's first token, feed nothing."""
    from pagedserve.core.traffic import TTFT_STEP_SHARE, TtftShare
    now = [0.0]
    classes = [{"name": "interactive", "priority": 0, "ttft_p99_ms": 1000}, {"name": "batch", "priority": 10}]
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=512, max_num_seqs=8),
                  KVCacheManager(400, 16, False, 0), clock=lambda: now[0], classes=TrafficClasses.parse(classes),
                  step_cost=lambda rows: 0.001 * sum(n for _, n, _ in rows))      # 1 ms a row
    assert s.ttft_share.value == TTFT_STEP_SHARE

    def first_tokens(klass, wait_s, k):
        for i in range(k):
            r = mk(f"{klass}{now[0]}.{i}", 20, klass, max_tokens=1)
            r.arrival_time = now[0]
            s.add_request(r)
            now[0] += wait_s
            step(s)
    first_tokens(1, 5.0, 10)                           # the batch class: no TTFT target, nothing observed
    assert s.ttft_share.steps == 0 and s.ttft_share.value == TTFT_STEP_SHARE
    first_tokens(0, 2.0, 10)                           # 2 s against 1 s: each one late
    assert s.ttft_share.misses == s.ttft_share.steps == 10 and s.ttft_share.value < 0.31
    s.add_request(mk("long", 500, 1))                  # a batch prompt: its chunk is cut to the step's share
    so = step(s)
    planned = s.ttft_headroom.value * s.ttft_share.value * 1.0          # seconds: 1 ms a row
    assert abs(so.seqs[0].num_tokens - planned * 1000) <= 1 and planned < s.ttft_headroom.value * TTFT_STEP_SHARE
    first_tokens(0, 0.1, 1200)                         # in time: the share climbs back, capped
    assert s.ttft_share.value == TTFT_STEP_SHARE and s.ttft_share.misses == 10
    assert TtftShare.LO < TtftShare.HI == TTFT_STEP_SHARE
