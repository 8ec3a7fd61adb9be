"""Speculative decoding's plain-Python half: the n-gram proposer, the drafting rule, the config's
refusals, and the scheduler's roll-back of rejected drafts (no model)."""
from __future__ import annotations

import pytest

from pagedserve.config import EngineArgs, SpeculativeConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.spec_decode import AcceptancePrior, Candidate, Drafting, StepCostTable, choose_drafts, \
    ngram_match, propose_ngram
from pagedserve.sampling_params import SamplingParams


def test_ngram_takes_the_longest_match_and_its_latest_occurrence():
    # "1 2 3" ends the sequence; it occurred twice before: the latest one (followed by 7 8) proposes
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert propose_ngram(toks, 1, 3, 2) == [7, 8]
    # with n at most 1 only "3" is matched: its latest earlier occurrence is followed by 7
    assert propose_ngram(toks, 1, 1, 3) == [7, 8, 6]
    assert propose_ngram([5, 6, 7], 1, 3, 4) == []                  # nothing occurred before
    assert propose_ngram([5, 6, 5], 2, 3, 4) == []                  # only a 1-gram matches, min is 2
    assert propose_ngram([5, 6, 5], 1, 3, 4) == [6, 5]              # the continuation may run into the suffix
    assert propose_ngram([1, 2, 1, 2], 1, 3, 0) == []


def test_ngram_ignores_byte_matches_that_straddle_tokens():
    # token 256 = bytes 00 01 00 00 and token 1 = 01 00 00 00: a byte search for [1] also finds the
    # inside of 256's bytes; only whole tokens count
    toks = [256, 0, 5, 1]
    assert propose_ngram(toks, 1, 1, 2) == []
    assert propose_ngram([1, 9, 256, 0, 1], 1, 1, 1) == [9]


def test_ngram_drafts_are_judged_by_the_length_of_their_match():
    """The proposal names the n-gram length that found it; the prior learns each length's acceptance,
    so in one sequence a short match's junk stops drafting while a long match keeps drafting whole."""
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    assert ngram_match(toks, 1, 3, 2) == ([7, 8], 3)
    assert ngram_match([5, 6, 5], 1, 3, 4) == ([6, 5], 1)
    assert ngram_match([5, 6, 7], 1, 3, 4) == ([], 0)
    prior = AcceptancePrior(0.6)
    assert prior.rate_of(1) == prior.rate_of(3) == prior.rate      # nothing seen: the engine-wide rate
    for _ in range(20):
        prior.update(4, 0, length=1)                                # 1-gram drafts: first token rejected
        prior.update(4, 4, length=3)                                # 3-gram drafts: all accepted
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=10), 10)
    assert prior.of(req, 1) < 0.25 < 0.9 < prior.of(req, 3)
    # the rule at 1 + 4 rows costing 1.8x one row: the 3-gram's draft whole, nothing for the 1-gram's
    cost = StepCostTable([1, 5], [0.010, 0.018])
    cands = [Candidate(req, [7, 8, 9, 10], prior.of(req, 1), length=1)]
    assert choose_drafts(cands, 1, 1, cost, 64) == {}
    cands = [Candidate(req, [7, 8, 9, 10], prior.of(req, 3), length=3)]
    assert choose_drafts(cands, 1, 1, cost, 64) == {0: 4}
    for _ in range(1000):                                           # no drafts for a while: back toward the prior
        prior.idle_step()
    assert abs(prior.rate_of(1) - 0.6) < 0.05 and abs(prior.rate_of(3) - 0.6) < 0.05


def test_rule_takes_no_draft_when_rows_cost_more_than_they_bring():
    cands = [Candidate(None, [7, 8, 9], 0.9), Candidate(None, [4], 0.2)]
    flat = StepCostTable([1, 2, 8], [0.020, 0.021, 0.026])         # weight-bound: rows are nearly free
    got = choose_drafts(cands, base_rows=2, base_tokens=2, cost=flat, budget=100)
    assert got == {0: 3, 1: 1}
    steep = StepCostTable([1, 64], [0.010, 0.640])                  # compute-bound: each row costs a whole step
    assert choose_drafts(cands, base_rows=2, base_tokens=2, cost=steep, budget=100) == {}
    # 2 tokens in 24 ms = 83/s; + 0.9 in 30 ms = 97/s; + 0.81 in 36 ms = 103/s (best); + 0.73 in 50 ms = 89/s
    mid = StepCostTable([1, 2, 3, 4, 5], [0.020, 0.024, 0.030, 0.036, 0.050])
    assert choose_drafts(cands, 2, 2, mid, 100) == {0: 2}
    assert choose_drafts(cands, 2, 2, flat, budget=2) == {0: 2}     # the step's token budget caps it
    assert choose_drafts(cands, 2, 2, None, budget=3) == {0: 3}     # adaptive off: proposals whole, budget first


def test_rule_counts_a_draft_models_passes():
    """With a draft model each proposing pass costs D(sequences in it): pass j runs the sequences that
    draft at least j tokens. Cheap passes leave the choice as it was; dear ones shorten or end it."""
    cands = [Candidate(None, [0] * 4, 0.9), Candidate(None, [0] * 4, 0.9)]
    flat = StepCostTable([1, 2, 16], [0.020, 0.021, 0.026])
    assert choose_drafts(cands, 2, 2, flat, 100) == {0: 4, 1: 4}
    cheap = StepCostTable([1, 2], [0.0005, 0.0006])
    assert choose_drafts(cands, 2, 2, flat, 100, cheap) == {0: 4, 1: 4}
    # a pass of 6 ms: the fourth pass (2 x 0.66 = 1.31 tokens) still pays, at 20 ms even the first does not
    assert choose_drafts(cands, 2, 2, flat, 100, StepCostTable([1, 2], [0.006, 0.006])) == {0: 4, 1: 4}
    assert choose_drafts(cands, 2, 2, flat, 100, StepCostTable([1, 2], [0.020, 0.020])) == {}
    # one sequence in a pass is cheaper than two: with acceptances 0.9 and 0.3, only the first drafts
    mixed = [Candidate(None, [0] * 4, 0.9), Candidate(None, [0] * 4, 0.3)]
    assert choose_drafts(mixed, 2, 2, flat, 100, StepCostTable([1, 2], [0.004, 0.008])) == {0: 4}


def test_a_rule_that_never_drafts_probes_one_sequence_now_and_then():
    """The prior alone may never pay for a draft model's passes while its drafts would be accepted
    almost always: after PROBE_EVERY steps without a draft, one sequence drafts once what it costs is
    within PROBE_SHARE of the step time since; what it measures moves the prior."""
    from pagedserve.core.spec_decode import PROBE_EVERY, PROBE_SHARE
    # 5 rows: 1.75x one; a pass costs half a step: at a prior of 0.6 none pays
    sch, kv = _sched(blocks=128, drafting=Drafting(SpeculativeConfig("draft_model", 4, model="x"),
                                                   StepCostTable([1, 5], [0.040, 0.070]),
                                                   draft_cost=StepCostTable([1], [0.020]), prior=0.6))
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=250), 250)
    sch.add_request(r)
    list(sch.update_from_output(sch.schedule(), {"a": [4]}))        # the prompt's step: the first without a draft
    drafted = []
    for step in range(200):
        so = sch.schedule()
        (s,) = so.seqs
        drafted.append(s.num_draft)
        if s.num_draft:                      # the runner's draft model fills the placeholders; all accepted
            assert s.draft == (-1,) * s.num_draft
            assert s.draft_prefix == tuple(r.all_token_ids[r.num_draft_computed:s.start])
            list(sch.update_from_output(so, {"a": [5] * (s.num_draft + 1)}))
            assert r.num_draft_computed == s.start + s.num_draft == r.num_computed_tokens - 1
        else:
            list(sch.update_from_output(so, {"a": [5]}))
        if len([d for d in drafted if d]) == 3:
            break
    p = next(i for i, d in enumerate(drafted) if d)
    probe_s = 0.070 - 0.040 + 4 * 0.020                             # 4 rows more and 4 passes
    assert p >= PROBE_EVERY and PROBE_SHARE * (p + 1) * 0.040 >= probe_s > PROBE_SHARE * p * 0.040
    assert drafted[p] == 4 and all(drafted[p + 1:])                 # the probe, then the rule drafts by itself


def test_a_draft_models_reading_counts_once_for_its_sequence():
    """A sequence whose draft KV lacks its context pays for reading it in the step it first drafts."""
    flat = StepCostTable([1, 2, 16], [0.020, 0.021, 0.026])
    passes = StepCostTable([1, 2], [0.001, 0.001])
    fresh = [Candidate(None, [0] * 4, 0.9, setup_s=0.100), Candidate(None, [0] * 4, 0.9, setup_s=0.0)]
    assert choose_drafts(fresh, 2, 2, flat, 100, passes) == {1: 4}
    assert choose_drafts([fresh[0]], 1, 1, flat, 100, passes) == {}
    assert choose_drafts([Candidate(None, [0] * 4, 0.9, setup_s=0.010)], 1, 1, flat, 100, passes) == {0: 4}


def test_cost_table_interpolates_and_extends():
    t = StepCostTable([1, 3, 5], [1.0, 2.0, 4.0])
    assert t(1) == 1.0 and t(2) == 1.5 and t(4) == 3.0 and t(7) == 6.0 and t(0) == 1.0


@pytest.mark.parametrize("value, names", [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"method": "draft_model", "model": ""}, "speculative_config.model"),
    ({"model": "x", "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "model": "x"}, "speculative_config.model"),
    ({"method": "ngram", "quantization": "gguf"}, "speculative_config.quantization"),
    ({"model": "x", "quantization": "q4"}, "speculative_config.quantization"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
    ({"num_spec_tokens": 3}, "speculative_config.num_spec_tokens"),
    ({"adaptive": "yes"}, "speculative_config.adaptive"),
    ("{not json", "speculative_config"),
    ("[1, 2]", "speculative_config"),
])
def test_bad_speculative_configs_are_refused_naming_the_key(value, names):
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        EngineArgs(speculative_config=value)


def test_speculative_config_parses_vllm_json_and_refuses_what_it_cannot_serve():
    a = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert SpeculativeConfig.parse(a.speculative_config) == SpeculativeConfig("ngram", 5, 1, 4, True)
    assert SpeculativeConfig.parse({"prompt_lookup_min": 5}).prompt_lookup_max == 5     # max follows a larger min
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(speculative_config={"method": "ngram"}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(speculative_config={"method": "ngram"}, scheduling_policy="static")


def _sched(k: int = 4, blocks: int = 64, bs: int = 4, budget: int = 64, drafting: Drafting | None = None):
    kv = KVCacheManager(blocks, bs, enable_caching=True)
    sch = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=256), kv,
                    drafting=drafting or Drafting(SpeculativeConfig(num_speculative_tokens=k, adaptive=False)))
    return sch, kv


def test_rejected_drafts_give_their_blocks_back_and_progress_rolls_back():
    sch, kv = _sched(k=4, bs=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]        # "1 2 3" occurred: drafts 4 5 6 7
    r = Request("a", prompt, SamplingParams(max_tokens=20), 20)
    sch.add_request(r)
    so = sch.schedule()                            # the prompt
    list(sch.update_from_output(so, {"a": [4]}))   # now ... 1 2 3 4: proposes 5 6 7 1
    free = kv.num_free_blocks
    so = sch.schedule()
    (s,) = so.seqs
    assert s.num_draft == 4 and s.draft == (5, 6, 7, 1) and s.token_ids == (4, 5, 6, 7, 1)
    assert so.num_draft_tokens == 4 and so.num_decode_tokens == 5 and so.num_prefill_tokens == 0
    assert kv.num_free_blocks == free - 1           # positions 10..14: block 3 (positions 12..15) added
    ups = list(sch.update_from_output(so, {"a": [9]}))        # draft 5 rejected: the runner's 9
    assert [u.token_id for u in ups] == [9]
    assert r.output_token_ids == [4, 9] and r.num_computed_tokens == 11 and r.num_tokens == 12
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == free     # block 3 held only rejected drafts
    so = sch.schedule()                                        # ... 4 9: "9" never occurred: no draft
    assert so.seqs[0].num_draft == 0
    list(sch.update_from_output(so, {"a": [1]}))               # ... 9 1: proposes 2 3 4 9 (after the latest 1)
    so = sch.schedule()
    assert so.seqs[0].draft == (2, 3, 4, 9)
    ups = list(sch.update_from_output(so, {"a": [2, 3, 7]}))  # two accepted, then 7
    assert [u.token_id for u in ups] == [2, 3, 7] and [u.sample_index for u in ups] == [0, 1, 2]
    assert r.num_computed_tokens == 15 and r.num_tokens == 16 and len(kv.block_ids("a")) == 4
    assert sch.spec_stats.num_drafts == 2 and sch.spec_stats.num_accepted_tokens == 2
    assert sch.spec_stats.accepted_per_pos == [1, 1, 0, 0]
    # the prefix cache only ever names full blocks of the request's own tokens
    assert kv.num_hashed["a"] <= r.num_tokens // 4


def test_a_draft_stops_at_max_tokens_and_a_finish_ends_the_run():
    sch, kv = _sched(k=8)
    r = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=3), 3)
    sch.add_request(r)
    list(sch.update_from_output(sch.schedule(), {"a": [3]}))
    (s,) = sch.schedule().seqs
    assert s.num_draft == 1                          # 3 tokens at most: 1 sampled, so 1 draft + the runner's own
    r2 = Request("b", [1, 2, 3, 1, 2], SamplingParams(max_tokens=10), 10, eos_token_ids=(9,))
    sch.add_request(r2)
    so = sch.schedule()
    list(sch.update_from_output(so, {s.request_id: [s.token_ids[-1]] for s in so.seqs}))
    so = sch.schedule()
    (sb,) = [s for s in so.seqs if s.request_id == "b"]
    ups = list(sch.update_from_output(so, {"b": [sb.draft[0], 9] if sb.num_draft > 1 else [9]}))
    assert ups[-1].finished and r2.status.finished and "b" not in kv.req_blocks


def test_the_cli_flag_takes_vllm_json_and_a_bad_one_is_a_clear_error(capsys):
    from pagedserve.entrypoints.cli import build_parser, main
    ns = build_parser().parse_args(["serve", "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert SpeculativeConfig.parse(EngineArgs.from_cli_args(ns).speculative_config).num_speculative_tokens == 3
    assert main(["generate", "x", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 40}']) == 2
    assert "speculative_config.num_speculative_tokens" in capsys.readouterr().err
