"""The experiment policies are real engine policies: contiguous reservation and static batching."""
from pagedserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(100 + 13 * i, 100 + 13 * i + 10 + 7 * i))} for i in range(6)]
LENS = [3, 9, 5, 12, 2, 7]


def _run(**kw):
    llm = LLM(num_kv_blocks=200, dtype="float32", **kw)     # the batch-invariant path: the policies batch differently
    eng = llm.engine
    for i, (p, n) in enumerate(zip(PROMPTS, LENS)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True))
    peak_running, steps, outs = 0, 0, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        peak_running = max(peak_running, len(eng.core.scheduler.running))
        steps += 1
    assert eng.core.kv.num_free_blocks == eng.core.kv.pool.num_usable_blocks
    return [outs[str(i)] for i in range(len(PROMPTS))], peak_running, steps


def test_contiguous_reservation_admits_fewer_in_the_same_pool():
    paged, peak_paged, _ = _run()
    contiguous, peak_contig, _ = _run(kv_allocation="contiguous", max_model_len=800)   # 50 blocks per request
    assert contiguous == paged
    assert peak_paged == 6 and peak_contig == 3


def test_static_batching_holds_the_batch_until_its_longest_member_ends():
    cont, _, steps_cont = _run(max_num_seqs=3)
    static, _, steps_static = _run(max_num_seqs=3, scheduling_policy="static")
    assert static == cont
    # static: batch [0,1,2] runs 9+ steps, then [3,4,5] runs 12+; continuous refills slots as rows finish
    assert steps_static > steps_cont
