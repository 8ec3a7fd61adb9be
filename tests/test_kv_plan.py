"""kv-plan reproduces the seed's worked example exactly."""
import json

import pytest

from pagedserve.entrypoints.cli import main
from pagedserve.kv_plan import plan

MiB = 2**20


def test_seed_table_exactly():
    p = plan(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16, lengths=[3900, 420, 2100, 70],
             max_len=4096)
    assert p.bytes_per_token == 131_072
    assert [r.blocks for r in p.requests] == [244, 27, 132, 5]
    assert [r.allocated_bytes / MiB for r in p.requests] == [488, 54, 264, 10]
    assert p.total_blocks == 408
    assert p.total_allocated_bytes / MiB == 816
    assert p.total_live_bytes / MiB == 811.25
    assert p.total_tail_waste_bytes / MiB == 4.75
    assert p.total_contiguous_bytes == 2 * 2**30
    assert [r.contiguous_bytes / MiB for r in p.requests] == [512] * 4


def test_cli_text_and_json(capsys):
    args = ["kv-plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp16",
            "--block-size", "16", "--lengths", "3900,420,2100,70", "--max-len", "4096"]
    assert main(args) == 0
    text = capsys.readouterr().out
    for s in ("131,072", "244", "27", "132", "488 MiB", "54 MiB", "264 MiB", "10 MiB", "408", "816 MiB",
              "811.25 MiB", "4.75 MiB", "2 GiB"):
        assert s in text, s
    assert main(args + ["--json", "--budget", "8GiB"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_blocks"] == 408 and d["total_contiguous_bytes"] == 2**31
    assert d["fit_paged"] == 16 and d["fit_contiguous"] == 16


def test_capacity_with_a_budget():
    p = plan(32, 8, 128, 2, 16, [70], max_len=4096, budget_bytes=2**30, fit_len=420)
    # 1 GiB = 512 blocks of 2 MiB; a 420-token request holds 27 blocks -> 18 fit; contiguous 4096 -> 2 fit
    assert (p.fit_paged, p.fit_contiguous) == (18, 2)


def test_bad_input(capsys):
    assert main(["kv-plan", "--layers", "32"]) == 2
    assert "--kv-heads" in capsys.readouterr().err


def test_kv_plan_reads_the_default_model(capsys):
    assert main(["kv-plan", "--model", "default", "--dtype", "fp32", "--lengths", "100"]) == 0
    assert "46,080" in capsys.readouterr().out     # 2 x 30 layers x 3 kv heads x 64 x 4 bytes


def test_sliding_window_layers_hold_only_their_window():
    """Gemma-3-4B's shape: 29 of 34 layers slide over 1,024 tokens; at 32k context the KV with the blocks
    behind the window given back is under a quarter of what full attention in every layer holds."""
    from pagedserve.kv_plan import plan
    p = plan(34, 4, 256, 2, 16, [32768], 32768, sliding_window=1024, sliding_layers=29)
    per_layer_block = 2 * 4 * 256 * 2 * 16
    # the engine's layout: 1 full group and 6 sliding groups of 5 layer planes (the last group's fifth
    # plane unused); a sliding group keeps 64 blocks back + this one
    assert p.requests[0].windowed_bytes == per_layer_block * (5 * 2048 + 30 * 65)
    assert p.requests[0].windowed_bytes < p.total_allocated_bytes / 4
    assert plan(34, 4, 256, 2, 16, [100], 100, sliding_window=1024, sliding_layers=29).requests[0].windowed_bytes \
        == plan(34, 4, 256, 2, 16, [100], 100).total_allocated_bytes * 35 // 34      # shorter than the window
    with pytest.raises(ValueError, match="sliding_layers"):
        plan(34, 4, 256, 2, 16, [100], 100, sliding_window=1024)


def test_arithmetic_does_not_load_the_engine():
    """kv-plan from explicit dimensions imports neither torch nor the engine (it is arithmetic: the
    CLI's parser once pulled both in through the routes' error types)."""
    import subprocess
    import sys
    code = ("import sys\nfrom pagedserve.entrypoints.cli import main\n"
            "main(['kv-plan', '--layers', '32', '--kv-heads', '8', '--head-dim', '128'])\n"
            "print(sorted(m for m in ('torch', 'pagedserve.engine.llm_engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_gpu_memory_utilization_sizes_the_kv_pool_from_what_the_gpu_has_left():
    """vLLM's rule per GPU: utilization x total, less what is in use after the weights (any process's) and
    the workspace; nothing left is a ValueError naming the parameter, and the argument is range-checked."""
    import pytest
    from pagedserve.config import EngineArgs
    from pagedserve.kv_plan import GiB, gpu_kv_budget
    assert gpu_kv_budget(free=120 * GiB, total=140 * GiB, utilization=0.9, workspace=2 * GiB) == \
        int(0.9 * 140 * GiB) - 20 * GiB - 2 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.1 leaves no KV cache memory"):
        gpu_kv_budget(free=120 * GiB, total=140 * GiB, utilization=0.1, workspace=0)
    for bad in (0, 1.5, -0.2, "0.9", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineArgs(gpu_memory_utilization=bad).validate()


def test_the_engines_kv_pool_is_sized_by_the_first_rule_that_applies():
    """pool_blocks, the engine's memory plan without a device: --num-kv-blocks as given; --kv-cache-memory
    in blocks; on a GPU (a `total` given) each rank's gpu_kv_budget x ranks; on the host 20 % of the
    free bytes after the workspace, at most 4 GiB; fewer than 2 blocks is a ValueError naming the
    parameter. The GPU branch runs only on a GPU otherwise: its arithmetic is checked here."""
    import pytest
    from pagedserve.config import EngineArgs
    from pagedserve.kv_plan import GiB, gpu_kv_budget, pool_blocks
    block = 2 * 2**20
    assert pool_blocks(EngineArgs(num_kv_blocks=77), block, 0, 0, None, 1) == (77, "num_kv_blocks")
    assert pool_blocks(EngineArgs(kv_cache_memory="64MiB"), block, 0, 0, None, 1) == (32, "kv_cache_memory")
    blocks, how = pool_blocks(EngineArgs(gpu_memory_utilization=0.9), block, GiB, 120 * GiB, 140 * GiB, 2)
    assert blocks == 2 * gpu_kv_budget(120 * GiB, 140 * GiB, 0.9, GiB) // block and "x 2 rank(s)" in how
    assert pool_blocks(EngineArgs(), block, GiB, 11 * GiB, None, 1)[0] == 2 * GiB // block      # 20 % of 10 GiB
    assert pool_blocks(EngineArgs(), block, 0, 100 * GiB, None, 1)[0] == 4 * GiB // block       # at most 4 GiB
    with pytest.raises(ValueError, match="kv_cache_memory .* fewer than 2 blocks"):
        pool_blocks(EngineArgs(kv_cache_memory="3MiB"), block, 0, 0, None, 1)
    # on the host: what max_num_seqs x max_model_len need, when that is under the cap; the cap above it
    small = EngineArgs(max_num_seqs=4, max_model_len=512)
    blocks, how = pool_blocks(small, block, 0, 100 * GiB, None, 1, need_blocks=129)
    assert blocks == 129 and "max_num_seqs 4 x max_model_len 512 need 129 blocks" in how and "would allow 2048" in how
    blocks, how = pool_blocks(EngineArgs(), block, 0, 100 * GiB, None, 1, need_blocks=10**6)
    assert blocks == 4 * GiB // block and "need 1000000 blocks" in how
