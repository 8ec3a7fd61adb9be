"""Tensor parallelism: TP ranks together compute what one rank computes (same greedy tokens, logits
within 1e-4) through the whole engine, chunked prefill and preemption included; bad sizes are
refused before any process starts; a dead rank fails the engine instead of hanging it; workers
never outlive their engine."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.distributed.sharding import check_tensor_parallel, shard_state_dict
from pagedserve.errors import EngineDeadError
from pagedserve.model.config import ModelConfig
from pagedserve.model.loader import read_model_config, resolve_model
from tests.model.helpers import save_random_llama


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory, tokenizer):
    """A random Llama with 4 query heads and 2 KV heads (an untied LM head: both vocab-parallel
    matrices), saved as safetensors with the default tokenizer."""
    return save_random_llama(tmp_path_factory.mktemp("tp-llama"), tokenizer, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=3, max_position_embeddings=4096, tie_word_embeddings=False)


# tight on purpose: 25 blocks of 4 tokens for 4 requests of up to ~70 tokens (preemption), 16-token
# prefill chunks (chunked prefill), a step budget of 32 tokens
TIGHT = dict(dtype="float32", num_kv_blocks=25, block_size=4, max_num_batched_tokens=32,
             long_prefill_token_threshold=16)


def _children() -> list[int]:
    """Live child processes of this process (see _descendants)."""
    return _descendants(os.getpid())


def _run(model: str, tp: int, prompts, params, **kw):
    if "num_kv_blocks" not in kw:     # the same pool bytes whatever the KV layout (a block id spans its planes)
        cfg = read_model_config(resolve_model(model))
        kw["num_kv_blocks"] = 1 + (TIGHT["num_kv_blocks"] - 1) * cfg.num_layers // cfg.kv_layout.planes
    with LLM(model, tensor_parallel_size=tp, **{**TIGHT, **kw}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.engine.core.counters.preemptions


def check_tp2_equals_tp1(model: str, backend: str) -> None:
    prompts = [f"Story {i}: " + "once upon a time there was a paged cache. " * (1 + i) for i in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=20, prompt_logprobs=3)
    one, pre1 = _run(model, 1, prompts, sp)
    two, pre2 = _run(model, 2, prompts, sp, distributed_executor_backend=backend)
    assert pre1 > 0 and pre2 > 0, "the pool was meant to force preemptions"
    assert max(len(o.prompt_token_ids) for o in one) > 16, "a prompt was meant to be chunked"
    worst = 0.0
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            worst = max(worst, max(abs(la[t].logprob - lb[t].logprob) for t in la))
        for la, lb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            worst = max(worst, max(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()))
    # log-softmax of logits within 1e-4 (the top 20 of every sampled position and the prompt's)
    assert worst < 1e-4, worst
    if backend == "mp":             # (Ray's own daemons are children of this process too)
        assert _children() == []


def test_tp2_equals_tp1_through_the_engine(small_llama):
    check_tp2_equals_tp1(small_llama, "mp")


def test_tp2_sampling_matches_with_a_seed(small_llama):
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, n=2)
    one, _ = _run(small_llama, 1, ["a b c d e f"], sp)
    two, _ = _run(small_llama, 2, ["a b c d e f"], sp)
    assert [c.token_ids for c in one[0].outputs] == [c.token_ids for c in two[0].outputs]


def test_tp3_on_the_default_model_gives_the_same_greedy_tokens():
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def fib(n):"]
    sp = SamplingParams(max_tokens=12, temperature=0)
    res = {}
    for tp in (1, 3):
        with LLM(None, dtype="float32", tensor_parallel_size=tp, num_kv_blocks=64) as llm:
            res[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert res[1] == res[3]
    assert _children() == []


def test_sizes_that_do_not_divide_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the model's 9 attention heads, "
                                         r"3 KV heads .*sizes that work for this model: \[1, 3\]"):
        LLM(None, tensor_parallel_size=2, num_kv_blocks=16)
    assert _children() == [] and multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=2, quantization="gguf")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="slurm")


def test_sharding_reassembles_to_the_whole_model():
    cfg = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=6, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=2)
    g = torch.Generator().manual_seed(0)
    sd = {"embed_tokens.weight": torch.randn(10, 8, generator=g), "norm": torch.randn(8, generator=g),
          "layers.0.qkv_proj.weight": torch.randn(16, 8, generator=g),
          "layers.0.o_proj.weight": torch.randn(8, 8, generator=g),
          "layers.0.gate_up_proj.weight": torch.randn(12, 8, generator=g),
          "layers.0.down_proj.weight": torch.randn(8, 6, generator=g)}
    parts = [shard_state_dict(cfg, sd, r, 2) for r in range(2)]
    q = torch.cat([p["layers.0.qkv_proj.weight"][:4] for p in parts])
    k = torch.cat([p["layers.0.qkv_proj.weight"][4:6] for p in parts])
    v = torch.cat([p["layers.0.qkv_proj.weight"][6:] for p in parts])
    assert torch.equal(torch.cat([q, k, v]), sd["layers.0.qkv_proj.weight"])
    assert torch.equal(torch.cat([p["layers.0.o_proj.weight"] for p in parts], 1), sd["layers.0.o_proj.weight"])
    assert torch.equal(torch.cat([p["layers.0.down_proj.weight"] for p in parts], 1), sd["layers.0.down_proj.weight"])
    gate = torch.cat([p["layers.0.gate_up_proj.weight"][:3] for p in parts])
    up = torch.cat([p["layers.0.gate_up_proj.weight"][3:] for p in parts])
    assert torch.equal(torch.cat([gate, up]), sd["layers.0.gate_up_proj.weight"])
    emb = torch.cat([p["embed_tokens.weight"] for p in parts])            # 2 x 5 rows: no padding needed
    assert torch.equal(emb, sd["embed_tokens.weight"]) and torch.equal(parts[1]["norm"], sd["norm"])
    three = [shard_state_dict(ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=6, num_layers=1,
                                          num_heads=3, num_kv_heads=3, head_dim=2),
                              {"embed_tokens.weight": sd["embed_tokens.weight"]}, r, 3) for r in range(3)]
    assert [p["embed_tokens.weight"].shape[0] for p in three] == [4, 4, 4]   # 10 ids padded to 3 x 4
    assert torch.equal(torch.cat([p["embed_tokens.weight"] for p in three])[:10], sd["embed_tokens.weight"])
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):
        check_tensor_parallel(cfg, 4)


def test_a_dead_worker_fails_the_engine_instead_of_hanging_it(small_llama):
    llm = LLM(small_llama, tensor_parallel_size=2, **TIGHT)
    try:
        (pid,) = _children()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor parallelism.*worker rank 1"):
            llm.generate(["hello"] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - t0 < 60
        with pytest.raises(EngineDeadError):        # and it stays dead, it does not run half a model
            llm.engine.core.executor.execute(llm.engine.core.last_schedule)
    finally:
        llm.shutdown()
    assert _children() == []


def test_workers_go_with_their_engine_even_without_shutdown(small_llama):
    import gc
    llm = LLM(small_llama, tensor_parallel_size=2, **TIGHT)
    assert len(_children()) == 1
    del llm
    gc.collect()
    deadline = time.monotonic() + 20
    while _children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children() == []


def test_ray_backend_passes_the_same_check(small_llama):
    """The TP=2 check above with the ranks placed as Ray actors on a local Ray instance."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        check_tp2_equals_tp1(small_llama, "ray")
    finally:
        ray.shutdown()


def test_torchrun_external_launcher_matches_one_rank(small_llama):
    """Every rank runs the same command under torchrun (env:// rendezvous); rank 0 prints."""
    cli = ["-m", "pagedserve.entrypoints.cli", "generate", "The paged cache", "--raw", "--max-tokens", "12",
           "--log-level", "info", "--model", small_llama, "--dtype", "float32", "--num-kv-blocks", "64"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *cli], capture_output=True, text=True, timeout=120, env=env)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), *cli, "--tensor-parallel-size", "2",
                          "--distributed-executor-backend", "external_launcher"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert one.stdout.strip() and two.stdout.strip() == one.stdout.strip()
    assert "tensor parallel: 2 ranks ready" in two.stderr


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Live processes whose parent is pid (zombies excluded), but multiprocessing's resource tracker:
    one per parent process, it ends with it."""
    out = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError):
            continue
        if p.isdigit() and int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in cmd:
            out.append(int(p))
    return out


def test_serve_with_tp2_answers_and_a_dead_rank_ends_the_server_cleanly(small_llama):
    import httpx
    from tests.entrypoints.helpers import serve_in_process
    args = [small_llama, "--tensor-parallel-size", "2", "--dtype", "float32", "--num-kv-blocks", "64",
            "--no-dashboard", "--dead-engine-grace", "0.5"]
    body = {"model": os.path.basename(small_llama), "prompt": "The paged cache", "max_tokens": 8, "temperature": 0}
    with serve_in_process(args) as (base, proc):
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        (core,) = _descendants(proc.pid)            # serve's engine core, in a process of its own (its default)
        (worker,) = _descendants(core)              # rank 1, the core's worker
        os.kill(worker, signal.SIGKILL)
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_dead"
        assert "worker rank 1" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1          # a supervisor restarts it
    with serve_in_process(args) as (base, proc):
        (core,) = _descendants(proc.pid)
        (worker,) = _descendants(core)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") for p in (core, worker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{worker}"), "the worker outlived its server"
        assert not os.path.exists(f"/proc/{core}"), "the engine core outlived its server"


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_tp2_equals_tp1_for_other_families(tmp_path, tokenizer, family):
    """Gemma 3 (q/k norms, sandwich norms, sliding windows, two RoPE tables) and Llama with
    attention_bias (a row-parallel o_proj bias, added once) split over two ranks like Llama does."""
    from tests.model.families import save_family
    save_family(family, tmp_path, len(tokenizer), tokenizer, sharpen=5.0)
    check_tp2_equals_tp1(str(tmp_path), "mp")


def test_moe_is_refused_with_tensor_parallelism():
    with pytest.raises(ValueError, match="experts"):
        check_tensor_parallel(ModelConfig(num_experts=4, num_experts_per_tok=2, arch="mixtral"), 2)
