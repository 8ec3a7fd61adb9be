"""Attention really reads through block tables, and a mixed batch equals each sequence alone."""
import torch

from pagedserve.runner.model_runner import ModelRunner
from tests.model.helpers import blocks_for, forward_all_rows, make_request

BS = 16


def _ids(n, seed):
    return torch.randint(17, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_batch_equals_each_sequence_alone(default_model):
    model, _ = default_model
    # five sequences: two prefill chunks (one of them after a cached prefix), three decodes
    specs = [  # (total tokens, tokens already in the cache before the mixed step)
        (40, 0), (70, 32), (20, 19), (33, 32), (90, 89)]
    seqs = [(make_request(f"s{i}", _ids(n, i)), done, n) for i, (n, done) in enumerate(specs)]

    alone = []
    for req, done, n in seqs:
        r = ModelRunner(model, num_blocks=12, block_size=BS)
        bl = blocks_for(1, n, BS)
        if done:
            forward_all_rows(r, [(req, 0, done, bl)])
        alone.append(forward_all_rows(r, [(req, done, n - done, bl)]))

    r = ModelRunner(model, num_blocks=40, block_size=BS)
    tables, first = [], 1
    for req, done, n in seqs:
        bl = blocks_for(first, n, BS)
        first += len(bl)
        tables.append(bl)
        if done:
            forward_all_rows(r, [(req, 0, done, bl)])
    mixed = forward_all_rows(r, [(req, done, n - done, bl) for (req, done, n), bl in zip(seqs, tables)])
    # the runner puts decodes first, then prefill chunks in order
    order = [i for i, (_, done, n) in enumerate(seqs) if n - done == 1] + \
            [i for i, (_, done, n) in enumerate(seqs) if n - done > 1]
    row = 0
    for i in order:
        k = alone[i].shape[0]
        # fp32 GEMMs round differently at different row counts (MKL picks kernels by shape), which
        # moves logits of magnitude ~20 by up to ~3e-3 after 30 layers; a wrong block moves them by O(1)
        assert (mixed[row:row + k] - alone[i]).abs().max().item() < 1e-2, f"sequence {i}"
        assert torch.equal(mixed[row:row + k].argmax(-1), alone[i].argmax(-1)), f"sequence {i}"
        row += k


def test_permuted_block_table_gives_identical_logits(default_model):
    model, _ = default_model
    ids = _ids(100, 7)
    n_blocks = -(-100 // BS)
    r = ModelRunner(model, num_blocks=2 * n_blocks + 2, block_size=BS)
    straight = list(range(1, n_blocks + 1))
    shuffled = (torch.randperm(n_blocks, generator=torch.Generator().manual_seed(3)) + n_blocks + 1).tolist()
    a, b = make_request("a", ids), make_request("b", ids)
    forward_all_rows(r, [(a, 0, 99, straight)])
    forward_all_rows(r, [(b, 0, 99, shuffled)])
    # the same K/V, held in other physical blocks in another order
    ka = r.kv_cache[:, :, straight].flatten(2, 3)[:, :, :99]
    kb = r.kv_cache[:, :, shuffled].flatten(2, 3)[:, :, :99]
    assert torch.equal(ka, kb)
    la = forward_all_rows(r, [(a, 99, 1, straight)])
    lb = forward_all_rows(r, [(b, 99, 1, shuffled)])
    assert torch.equal(la, lb)
    # and a wrong table gives different logits: the read really follows the table
    lc = forward_all_rows(r, [(b, 99, 1, list(reversed(shuffled)))])
    assert not torch.allclose(la, lc)


def test_prefill_chunks_take_the_native_kernel_only_where_it_pays(default_model, monkeypatch):
    """The rule (kernels.native_prefill_pays): AVX-512 levels run prefill chunks natively, lower ones
    through SDPA; the env var decides instead; either way a mixed step gives the same logits."""
    from pagedserve import kernels
    model, _ = default_model
    level = kernels.host_levels()[0]
    monkeypatch.delenv("PAGEDSERVE_PREFILL_ATTENTION", raising=False)
    assert kernels.native_prefill_pays() == level.startswith("avx512")
    logits = {}
    for forced in ("native", "torch"):
        monkeypatch.setenv("PAGEDSERVE_PREFILL_ATTENTION", forced)
        assert kernels.native_prefill_pays() == (forced == "native")
        runner = ModelRunner(model, num_blocks=32, block_size=16)
        assert runner.native_prefill == (runner.use_native and forced == "native")
        ids = list(range(100, 140))
        a, b = make_request("a", ids), make_request("b", ids[:23])
        forward_all_rows(runner, [(a, 0, 40, blocks_for(1, 40, 16)), (b, 0, 23, blocks_for(4, 23, 16))])
        logits[forced] = forward_all_rows(runner, [(a, 39, 1, blocks_for(1, 40, 16)), (b, 16, 7, blocks_for(4, 23, 16))])
    assert torch.allclose(logits["native"], logits["torch"], atol=1e-4, rtol=0)


def test_prefill_multiplies_in_bf16_only_for_a_bf16_model_on_a_bf16_cache(default_model, default_source):
    """kernels.bf16_dots rounds queries and probabilities to bf16: a float32 model (even on a bf16 cache) keeps
    float32 products and its exactness; a bf16 model on a bf16 cache takes them where the host has AVX512-BF16,
    and its prefill logits move from the float32-product kernel's by about what bf16 moves them from float32 (here
    0.09 against 0.12 on average; a wrong product would be far off)."""
    from pagedserve import kernels
    from pagedserve.model.loader import load_model
    model, _ = default_model
    assert not ModelRunner(model, num_blocks=8, block_size=BS).bf16_dots
    assert not ModelRunner(model, num_blocks=8, block_size=BS, kv_cache_dtype=torch.bfloat16).bf16_dots
    bf16, _ = load_model(default_source, dtype=torch.bfloat16)
    runners = {"bf16": ModelRunner(bf16, num_blocks=16, block_size=BS),
               "bf16, float32 products": ModelRunner(bf16, num_blocks=16, block_size=BS),
               "float32": ModelRunner(model, num_blocks=16, block_size=BS)}
    dots = runners["bf16"].bf16_dots
    assert dots == (runners["bf16"].native_prefill and kernels.bf16_dots())
    runners["bf16, float32 products"].bf16_dots = False
    ids, logits = _ids(150, 3), {}
    for name, runner in runners.items():
        req = make_request("a", ids)
        forward_all_rows(runner, [(req, 0, 100, blocks_for(1, 150, BS))])
        logits[name] = forward_all_rows(runner, [(req, 100, 50, blocks_for(1, 150, BS))]).float()
    products = (logits["bf16"] - logits["bf16, float32 products"]).abs().mean().item()
    rounding = (logits["bf16, float32 products"] - logits["float32"]).abs().mean().item()
    assert (products > 0) == dots
    assert products < 2 * rounding
