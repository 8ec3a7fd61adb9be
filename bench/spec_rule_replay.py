"""The n-gram drafting rule replayed on fixed greedy outputs (issue 25): deterministic, free of the host's
timing noise, so two estimates of acceptance can be compared where bench/spec_decode.py's ratios move
by more than their difference from run to run.

Each prompt of bench/spec_decode.py's workloads is decoded once without drafts (greedy, so with drafts
the output is the same tokens); then, per workload and per estimate, the rule (core/spec_decode.py:
ngram_match, AcceptancePrior, choose_drafts, update_acceptance: the scheduler's own functions) walks
each output as a one-stream engine would: at every step it proposes, chooses the draft tokens by the
step-cost table and the estimate, accepts the proposal's longest prefix that equals the output, and
the step costs T(1 + drafts). T is measured on this host with real contexts: the mean step time of
an engine's greedy decode of the same prompts at 1 + m rows (m forced drafts), so attention and
sampling are in it. Reported: steps, modelled seconds and their ratio to one-row decoding.

Estimates: `length` (the engine's: a sequence's own acceptance shrunk toward its n-gram length's rate)
and `engine-wide` (every draft counted as one kind, as before issue 25's length rates).

Usage: python bench/spec_rule_replay.py [--k 4,8] [--tokens 128] [--workloads grounded,chat]
"""
import argparse
import statistics
import sys
import time

from spec_decode import WORKLOADS, prompt_ids

from pagedserve import LLM, SamplingParams
from pagedserve.core.request import Request
from pagedserve.core.spec_decode import (PRIOR_ACCEPTANCE, AcceptancePrior, Candidate, StepCostTable, choose_drafts,
                                         ngram_match, update_acceptance)
from pagedserve.host import describe


def measured_costs(prompts: list[list[int]], tokens: int, k: int) -> StepCostTable:
    """Step seconds at 1 + m rows (m = 0..k): engines that always draft m tokens (n-gram proposals
    padded with the last token, so every step has m), decoding the prompts; the mean decode step."""
    rows, seconds = [], []
    for m in range(k + 1):
        sc = None if m == 0 else {"method": "ngram", "num_speculative_tokens": m, "adaptive": False}
        llm = LLM(num_kv_blocks=512, speculative_config=sc)
        core, sch = llm.engine.core, llm.engine.core.scheduler
        if m:                                       # every step drafts m tokens (mostly rejected: that is fine)
            sch_cands = sch._candidates

            def padded(plan, sch_cands=sch_cands, m=m):
                cands = sch_cands(plan)
                have = {id(c.request) for c in cands}
                for req, n in plan:
                    if n == 1 and id(req) not in have and req.num_computed_tokens + 1 == req.num_tokens:
                        cands.append(Candidate(req, [], 1.0))
                for c in cands:
                    room = min(m, c.request.max_tokens - c.request.num_output_tokens - 1)
                    c.draft = (list(c.draft) + [c.request.all_token_ids[-1]] * m)[:room]
                return [c for c in cands if c.draft]
            sch._candidates = padded
        times = []
        for ids in prompts:
            llm.engine.add_request("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                                   ignore_eos=True))
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
                st = core.last_stats
                if not st.num_prefill_tokens and st.num_draft_tokens == m:
                    times.append(st.step_s)
        rows.append(1 + m)
        seconds.append(statistics.mean(times))
        del llm
    return StepCostTable(rows, seconds)


def replay(prompts, outputs, cost: StepCostTable, k: int, by_length: bool, n_min=1, n_max=3) -> tuple[int, float]:
    prior = AcceptancePrior(PRIOR_ACCEPTANCE["ngram"])
    steps, secs = 0, 0.0
    for ids, out in zip(prompts, outputs):
        req = Request("r", list(ids), SamplingParams(max_tokens=len(out)), len(out))
        t = 0
        while t < len(out):
            room = min(k, len(out) - t - 1)
            draft, length = ngram_match(list(ids) + out[:t], n_min, n_max, room)
            length = length if by_length else 0
            m = 0
            if draft:
                chosen = choose_drafts([Candidate(req, draft, prior.of(req, length), length=length)], 1, 1, cost, 64)
                m = chosen.get(0, 0)
            accepted = 0
            while accepted < m and draft[accepted] == out[t + accepted]:
                accepted += 1
            if m:
                prior.update(m, accepted, length)
                update_acceptance(req, m, accepted)
            else:
                prior.idle_step(cost(1))
            steps += 1
            secs += cost(1 + m)
            t += accepted + 1
    return steps, secs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--workloads", default="grounded,chat")
    a = ap.parse_args()
    ks = [int(x) for x in a.k.split(",")]
    print(f"host: {describe()}; {time.strftime('%Y-%m-%d')}")
    workloads = {w: prompt_ids(WORKLOADS[w]) for w in a.workloads.split(",")}
    llm = LLM(num_kv_blocks=512)
    outputs = {w: [llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=a.tokens, temperature=0.0),
                                use_tqdm=False)[0].outputs[0].token_ids for ids in ps] for w, ps in workloads.items()}
    del llm
    cost = measured_costs(workloads[next(iter(workloads))], a.tokens, max(ks))
    print("step ms by rows: " + " ".join(f"{r}:{s * 1e3:.2f}" for r, s in cost.as_dict().items()))
    print(f"{'workload':9} {'k':>3} {'estimate':12} {'steps':>6} {'modelled s':>10} {'vs off':>7}")
    for w, ps in workloads.items():
        off = sum(len(o) for o in outputs[w]) * cost(1)
        for k in ks:
            for by_length in (False, True):
                steps, secs = replay(ps, outputs[w], cost, k, by_length)
                print(f"{w:9} {k:3d} {'length' if by_length else 'engine-wide':12} {steps:6d} {secs:10.3f} "
                      f"{off / secs:6.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
