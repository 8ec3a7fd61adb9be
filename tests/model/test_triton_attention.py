"""The Triton attention kernels (CUDA's attention path) in Triton's interpreter, against the torch path of
model/attention.py (each context gathered, then SDPA): the K/V write by slot mapping, decode attention split
over the context, varlen prefill reading the cache through the block tables; odd block sizes, partial last
blocks, GQA ratios 1 / 3 / 8, windows, a soft-cap, every KV format. Then engine steps of small random models
with attention_backend="triton": the same tokens as the torch path and as HF transformers, in float32.
Without a GPU tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton; with one (bench/
gpu_check.py) the same tests run compiled on CUDA tensors."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve import LLM, SamplingParams                                          # noqa: E402
from pagedserve.kernels import triton_attention as ta                               # noqa: E402
from pagedserve.model.attention import (AttentionMetadata, LayerKV, decode_attention,  # noqa: E402
                                        prefill_attention, write_kv)
from tests.model.families import save_family, tiny_tokenizer                          # noqa: E402
from tests.model.helpers import assert_greedy_match, hf_greedy                      # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
# (atol, rtol): float32 and int8 (dequantized to float32) agree up to summation order; half types within
# two units in the last place of the output (bfloat16: 2 x 2^-7 relative)
TOL = {"float32": (1e-5, 0), "int8": (1e-5, 0), "bfloat16:float32": (1e-5, 0), "bfloat16": (2e-2, 1.6e-2),
       "int8:bfloat16": (2e-2, 1.6e-2), "float16": (4e-3, 2e-3)}


def test_the_kernels_run_in_the_interpreter_without_a_gpu():
    assert ta.INTERPRETED == (DEVICE == "cpu"), "tests/conftest.py sets TRITON_INTERPRET=1 without a GPU"


def _cache(nb: int, bs: int, n_kv: int, hd: int, dtype: torch.dtype) -> LayerKV:
    z = lambda dt: torch.zeros(nb, bs, n_kv, hd, dtype=dt, device=DEVICE)         # noqa: E731
    if dtype == torch.int8:
        s = lambda: torch.zeros(nb, bs, n_kv, device=DEVICE)                       # noqa: E731
        return LayerKV(z(dtype), z(dtype), s(), s())
    return LayerKV(z(dtype), z(dtype))


def _filled(nb, bs, n_kv, hd, kv_name, seed=0) -> tuple[LayerKV, torch.dtype]:
    """A pool every slot of which the torch path has written (block 0 too: the null block is read as padding).
    kv_name "CACHE:QUERY" for a cache in another type than the queries (--kv-cache-dtype)."""
    g = torch.Generator().manual_seed(seed)
    kv_name, _, q_name = kv_name.partition(":")
    dtype = DTYPES[kv_name]
    qdt = DTYPES[q_name] if q_name else torch.float32 if dtype == torch.int8 else dtype
    kv = _cache(nb, bs, n_kv, hd, dtype)
    k, v = (torch.randn(nb * bs, n_kv, hd, generator=g).to(qdt).to(DEVICE) for _ in range(2))
    write_kv(kv, k, v, torch.arange(nb * bs, device=DEVICE))
    return kv, qdt


@pytest.mark.parametrize("kv_name", list(DTYPES))
@pytest.mark.parametrize("bs", [1, 5, 16])
def test_write_kv_fills_the_slots_the_torch_path_fills(kv_name, bs):
    """Bit for bit, int8 codes (rounded half to even as torch.round) and scales included; a strided source
    (K and V are views of one QKV row in the model)."""
    n_kv, hd, nb = 3, 40, 12
    dtype = DTYPES[kv_name]
    qdt = torch.float32 if dtype == torch.int8 else dtype
    g = torch.Generator().manual_seed(bs)
    T = 2 * bs + 3
    kvrow = (torch.randn(T, 2 * n_kv, hd, generator=g) * 3).to(qdt)
    kvrow[0, 0, :4] = torch.tensor([0.5, -1.5, 2.5, 127.0]).to(qdt)      # int8: scale 1, so .5 ties (half to even)
    kvrow = kvrow.to(DEVICE)
    k, v = kvrow[:, :n_kv], kvrow[:, n_kv:]
    slots = (torch.randperm((nb - 1) * bs, generator=g)[:T] + bs).to(DEVICE)        # never the null block
    ref, ours = _cache(nb, bs, n_kv, hd, dtype), _cache(nb, bs, n_kv, hd, dtype)
    write_kv(ref, k, v, slots)
    write_kv(ours, k, v, slots, triton=True)
    for a, b in zip((ref.k, ref.v, ref.k_scale, ref.v_scale), (ours.k, ours.v, ours.k_scale, ours.v_scale)):
        if a is not None:
            assert torch.equal(a, b)


def _tables(lens: list[int], bs: int, nb: int, seed: int) -> torch.Tensor:
    """Each sequence's blocks, shuffled over the pool, padded with the null block."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    rows = []
    for n in lens:
        own = (torch.randperm(nb - 1, generator=g)[: -(-n // bs)] + 1).tolist()
        rows.append(own + [0] * (width - len(own)))
    return torch.tensor(rows, dtype=torch.long, device=DEVICE)


CASES = [  # (kv format, block size, GQA group, window, soft-cap)
    ("float32", 5, 1, 0, None), ("float32", 16, 3, 0, None), ("float32", 3, 8, 0, None),
    ("float32", 5, 3, 7, None), ("float32", 16, 3, 0, 5.0), ("float32", 5, 8, 9, 5.0),
    ("bfloat16", 5, 3, 0, None), ("bfloat16", 16, 8, 7, None),
    ("float16", 16, 1, 0, None), ("float16", 5, 3, 7, 5.0),
    ("int8", 5, 3, 0, None), ("int8", 16, 8, 7, None), ("int8", 3, 1, 0, 5.0),
    ("bfloat16:float32", 5, 3, 7, None), ("int8:bfloat16", 16, 3, 0, None),
]


@pytest.mark.parametrize("kv_name,bs,G,window,softcap", CASES)
def test_decode_attention_matches_the_torch_path(kv_name, bs, G, window, softcap):
    """Contexts of one position, a full last block, partial last blocks; head dim 40 (padded tiles)."""
    n_kv, hd = 2, 40
    lens = [1, 2 * bs, 2 * bs + 1, 23]
    nb = 2 + sum(-(-n // bs) for n in lens)
    kv, qdt = _filled(nb, bs, n_kv, hd, kv_name)
    bt = _tables(lens, bs, nb, seed=bs + G)
    q = torch.randn(len(lens), n_kv * G, hd, generator=torch.Generator().manual_seed(1)).to(qdt).to(DEVICE)
    lt = torch.tensor(lens, device=DEVICE)
    md = AttentionMetadata(torch.arange(len(lens), device=DEVICE), len(lens), bt, lt)
    ref = decode_attention(q, kv, md, 0.19, window=window, softcap=softcap, native=False)
    got = ta.decode_attention(q, kv, bt, lt, 0.19, window, softcap)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[kv_name][0], rtol=TOL[kv_name][1])


@pytest.mark.parametrize("kv_name,window", [("float32", 0), ("float32", 300), ("bfloat16", 0), ("int8", 0)])
def test_decode_attention_split_over_a_long_context(kv_name, window):
    """Contexts over ta.SPLIT_TOKENS take several splits merged by their log-sum-exp; a window longer than
    one split too."""
    n_kv, G, hd, bs = 1, 3, 32, 16
    lens = [ta.SPLIT_TOKENS * 2 + 37, 5, ta.SPLIT_TOKENS + 1]
    nb = 2 + sum(-(-n // bs) for n in lens)
    kv, qdt = _filled(nb, bs, n_kv, hd, kv_name)
    bt = _tables(lens, bs, nb, seed=3)
    q = torch.randn(len(lens), n_kv * G, hd, generator=torch.Generator().manual_seed(2)).to(qdt).to(DEVICE)
    lt = torch.tensor(lens, device=DEVICE)
    md = AttentionMetadata(torch.arange(len(lens), device=DEVICE), len(lens), bt, lt)
    ref = decode_attention(q, kv, md, 0.2, window=window, native=False)
    got = ta.decode_attention(q, kv, bt, lt, 0.2, window, max_context=max(lens))
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[kv_name][0], rtol=TOL[kv_name][1])


@pytest.mark.parametrize("kv_name,bs,G,window,softcap", CASES)
def test_prefill_attention_reads_the_cache_in_place(kv_name, bs, G, window, softcap):
    """Chunks of one step: a whole prompt, a chunk after a cached prefix (a prefix hit or an earlier chunk),
    a one-token chunk, a chunk longer than one program's query tile."""
    n_kv, hd = 2, 40
    shapes = [(9, 9), (7, 2 * bs + 6), (1, bs + 1), (21, 30)]           # (q_len, context)
    lens = [n for _, n in shapes]
    nb = 2 + sum(-(-n // bs) for n in lens)
    kv, qdt = _filled(nb, bs, n_kv, hd, kv_name)
    bt = _tables(lens, bs, nb, seed=bs * G)
    cu = torch.tensor([0] + torch.tensor([q for q, _ in shapes]).cumsum(0).tolist(), device=DEVICE)
    q = torch.randn(int(cu[-1]), n_kv * G, hd, generator=torch.Generator().manual_seed(4)).to(qdt).to(DEVICE)
    lt = torch.tensor(lens, device=DEVICE)
    md = AttentionMetadata(torch.arange(int(cu[-1]), device=DEVICE), 0, None, None, bt, cu, lt)
    ref = prefill_attention(q, kv, md, 0.19, window=window, softcap=softcap, native=False)
    got = ta.prefill_attention(q, kv, bt, cu, lt, 0.19, window, softcap)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[kv_name][0], rtol=TOL[kv_name][1])


def test_a_step_of_decode_rows_and_prefill_chunks_through_paged_attention():
    """model/attention.paged_attention with md.triton: decode rows first, then prefill chunks, one call."""
    from pagedserve.model.attention import paged_attention
    n_kv, G, hd, bs = 2, 3, 32, 8
    dec, pre = [17, 4], [(6, 6), (5, 21)]
    lens = dec + [n for _, n in pre]
    nb = 2 + sum(-(-n // bs) for n in lens)
    kv, _ = _filled(nb, bs, n_kv, hd, "float32")
    bt = _tables(lens, bs, nb, seed=5)
    cu = torch.tensor([0, 6, 11], device=DEVICE)
    T = len(dec) + 11
    q = torch.randn(T, n_kv * G, hd, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    common = dict(slot_mapping=torch.arange(T, device=DEVICE), num_decodes=2, decode_block_tables=bt[:2],
                  decode_context_lens=torch.tensor(dec, device=DEVICE), prefill_block_tables=bt[2:], prefill_cu_q=cu,
                  prefill_context_lens=torch.tensor([6, 21], device=DEVICE))
    ref = paged_attention(q, kv, AttentionMetadata(**common), 0.2)
    got = paged_attention(q, kv, AttentionMetadata(**common, triton=True, max_decode_context=17, max_prefill_q=6), 0.2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- engine steps

ENGINE_FAMILIES = ["llama", "qwen3", "gemma2"]     # GQA with biases; q/k norms + a window layer; soft-cap + windows


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Models with a 512-id word-level tokenizer: nothing here reads the bundled GGUF."""
    tok, out = tiny_tokenizer(512), {}
    for name in ENGINE_FAMILIES:
        d = tmp_path_factory.mktemp(f"triton-{name}")
        out[name] = (str(d), save_family(name, d, len(tok), tok, sharpen=5.0))
    return out


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_engine_on_the_triton_path_gives_the_torch_paths_tokens(folders, name):
    """float32, chunked prefill (16-token chunks: later chunks read the earlier ones through the block
    tables), block size 8, then the same prompts again (prefix hits: chunks after a cached prefix):
    exactly the torch path's tokens, and HF's by the float32 rule."""
    d, hf = folders[name]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        with LLM(d, dtype="float32", num_kv_blocks=48, block_size=8, max_num_batched_tokens=32,
                 long_prefill_token_threshold=16, attention_backend=backend, device=DEVICE) as llm:
            assert llm.engine.core.runner.attention_backend == backend
            runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                    for _ in range(2)]
            assert llm.engine.core.kv.pool.num_cached_blocks() > 0
        tokens[backend] = [[list(o.outputs[0].token_ids) for o in outs] for outs in runs]
        assert tokens[backend][0] == tokens[backend][1]
    assert tokens["triton"] == tokens["torch"]
    for p, got in zip(prompts, tokens["triton"][0]):
        ref, ref_lp = hf_greedy(hf, p, 10)
        assert_greedy_match(got, ref, ref_lp, tol=1e-4)


def test_attention_backend_and_device_are_checked(folders):
    from pagedserve.config import EngineArgs
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="flash").validate()
    if DEVICE == "cpu":        # a CUDA device asked for where none is: the parameter named, not torch's assert
        with pytest.raises(ValueError, match="device cuda: no CUDA device is visible"):
            LLM(folders["llama"][0], device="cuda")


def test_graph_sizes_are_powers_of_two_then_max_num_seqs():
    from pagedserve.runner.cuda_graphs import graph_sizes
    assert graph_sizes(1) == [1]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_sizes(6) == [1, 2, 4, 6]


def test_decode_steps_through_the_graph_buffers_give_the_plain_steps_tokens(folders):
    """What a CUDA graph replays: decode rows copied into persistent buffers, padded up to a graph size
    (padding rows write the null block's slot 0), block tables max_model_len wide, the split count fixed by
    max_model_len. Without a GPU the buffers run eagerly (capture=False); on one the graphs are captured
    at start-up. Requests of different lengths end at different steps, so batches shrink (stale rows of a
    larger step must not write live slots): the tokens of plain eager steps, exactly, in float32. The plain
    steps take the torch path, whose tokens the Triton path's plain steps give exactly (the test above): in
    Triton's interpreter a run of Triton steps took most of this test's time."""
    from pagedserve.runner.cuda_graphs import DecodeGraphs
    d, hf = folders["llama"]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 12)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (4, 12, 7, 9, 2)]
    tokens = {}
    for graphs in (False, True):
        with LLM(d, dtype="float32", num_kv_blocks=48, block_size=8, max_num_seqs=6, max_model_len=300,
                 attention_backend="triton" if graphs else "torch", device=DEVICE, enforce_eager=not graphs) as llm:
            r = llm.engine.core.runner
            if DEVICE == "cpu":
                assert r.graphs is None and r.graphs_note.startswith("off")
                if graphs:
                    r.graphs = DecodeGraphs(r.model, r.kv_caches, 6, llm.engine.core.max_model_len, 8, r.device,
                                            capture=False)
            else:
                assert (r.graphs is not None) == graphs, r.graphs_note
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens[graphs] = [list(o.outputs[0].token_ids) for o in outs]
            if graphs:
                assert r.graphs.replays >= 10 and r.graphs.sizes == [1, 2, 4, 6]
                assert r.graphs.lens.shape == (6,) and r.graphs.tables.shape == (6, 38)
    assert tokens[True] == tokens[False]


def test_every_kernel_compiles_for_an_h200_without_one():
    """Triton's own compiler (LLVM, ptxas) builds each kernel for sm_90 here, in a process without the
    interpreter: what the interpreter cannot see (tl.dot's minimum tile sizes, register and shared-memory
    limits, types the NVIDIA backend refuses) fails here, before a GPU session. Each kernel's shared memory
    within the H200's 227 KiB per block."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # Triton's cache (~/.triton) keys each binary by the kernel's source, its constants and the compiler:
    # a hit is the same compile; a clean machine spends ~30 s here once
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": root}
    r = subprocess.run([sys.executable, "tests/model/triton_aot.py", "90", "--quick"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0, [x for x in recs if not x["ok"]] or r.stderr[-3000:]
    assert {x["kernel"] for x in recs} == {"decode", "prefill", "merge", "write_kv"} and len(recs) == 30
    assert all(x["cubin_bytes"] > 0 and x["shared_bytes"] <= 227 * 1024 for x in recs)
