"""Few-row steps (decode rows, prefill chunks) in one native call (LlamaForCausalLM.fused, kernels/layer_ops.c
decode_layers) against the layer-by-layer path they replace: the same logits bit for bit in float32 (packed products
with float or int8-rounded activations, float32 or int8 K/V, attention biases), the closeness rule in
bfloat16 (where the fused step keeps its residual stream in float32), and the steps it leaves alone."""
import pytest
import torch

from pagedserve.model.loader import load_model, resolve_model
from pagedserve.runner.model_runner import ModelRunner
from tests.model.families import save_family
from tests.model.helpers import blocks_for, forward_all_rows, make_request, packed_up_to

PROMPTS = (20, 33, 47)        # three sequences; block size 16, so decodes cross block boundaries
DECODES = 6


@pytest.fixture(autouse=True)
def native_prefill(monkeypatch):
    """The native prefill kernel on every host: AVX2 ones give prompt rows to SDPA by default
    (kernels.native_prefill_pays), and the fused call takes prompt chunks only where the native kernel is the
    layer path's; here both paths run it, so the prefill chunks' fused steps are checked on every host."""
    monkeypatch.setenv("PAGEDSERVE_PREFILL_ATTENTION", "native")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The families' random Llama (tests/model/families.py): biases on q/k/v and o that the products add,
    non-trivial norms."""
    d = tmp_path_factory.mktemp("tiny-llama-fused")
    save_family("llama", d, 512)
    return str(d)


def _decode_logits(model, kv_dtype, count: bool = True, seed: int = 1) -> tuple[torch.Tensor, int]:
    """Prefill three prompts (the first two in one step, the third's first 30 tokens beside the first
    decode rows, the rest of it with the next: chunks with a cached prefix), then DECODES steps of the three
    as decode rows: every step's logits, and how many steps took the fused call (when `count`)."""
    runner = ModelRunner(model, num_blocks=40, block_size=16, kv_cache_dtype=kv_dtype)
    g = torch.Generator().manual_seed(seed)
    reqs, blocks, first = [], [], 1
    for i, n in enumerate(PROMPTS):
        ids = torch.randint(0, 512, (n + DECODES,), generator=g).tolist()
        reqs.append(make_request(f"r{i}", ids))
        blocks.append(blocks_for(first, n + DECODES, 16))
        first += len(blocks[-1])
    fused, calls = model.fused, []
    if fused is not None and count:
        run = fused.run
        fused.run = lambda *a: calls.append(1) or run(*a)
    (a, b, c), (na, nb, nc), (ba, bb, bc) = reqs, PROMPTS, blocks
    steps = [[(a, 0, na, ba), (b, 0, nb, bb)], [(a, na, 1, ba), (b, nb, 1, bb), (c, 0, 30, bc)],
             [(a, na + 1, 1, ba), (b, nb + 1, 1, bb), (c, 30, nc - 30, bc)]]
    steps += [[(r, n + j, 1, bl) for r, n, bl in zip(reqs, PROMPTS, blocks)] for j in range(2, DECODES)]
    try:
        out = [forward_all_rows(runner, step) for step in steps]
    finally:
        if fused is not None and count:
            del fused.run
    return torch.cat(out), len(calls)


def _both_paths(path: str, dtype: torch.dtype, int8_act: bool, kv_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    model, _ = load_model(resolve_model(path), dtype, quantization="int8", int8_act=int8_act)
    assert packed_up_to(model).startswith("decode steps: every layer in one native call for up to 64 rows")
    fused, calls = _decode_logits(model, kv_dtype)
    assert calls == DECODES + 1                   # every step took the one call (prefill chunks too)
    keep, model.fused = model.fused, None
    try:
        layered, calls = _decode_logits(model, kv_dtype)
    finally:
        model.fused = keep
    assert calls == 0
    return fused, layered


@pytest.mark.parametrize("int8_act,kv_dtype", [(False, torch.float32), (True, torch.float32), (True, torch.int8)])
def test_fused_decode_is_the_layer_path_bit_for_bit_in_float32(tiny_llama, int8_act, kv_dtype):
    fused, layered = _both_paths(tiny_llama, torch.float32, int8_act, kv_dtype)
    assert torch.equal(fused, layered)


def test_fused_decode_in_bfloat16_holds_the_closeness_rule(tiny_llama):
    """A bfloat16 model's layers round the residual stream to bfloat16; the fused step keeps it in float32:
    each step's greedy token is in the other path's top 5, and the logits are close."""
    fused, layered = _both_paths(tiny_llama, torch.bfloat16, True, torch.bfloat16)
    top5 = layered.topk(5, dim=-1).indices
    assert (top5 == fused.argmax(-1, keepdim=True)).any(-1).all()
    assert (fused - layered).abs().max().item() < 0.1 * layered.abs().max().item()


def test_decode_steps_the_fused_call_leaves_to_the_layers(tiny_llama, tmp_path, monkeypatch):
    """Dense weights, a family option the native glue lacks (Qwen3's q/k norms), and either switch off:
    layer by layer, and the load line says why. A step with prefill rows takes it only where the layers'
    prefill attention is the native kernel, without LoRA and within the packed products' rows; a decode
    step whose LoRA slots are not float32 never does."""
    dense, _ = load_model(resolve_model(tiny_llama), torch.float32)
    assert dense.fused is None
    assert "dense weights" in dense.choose_decode_path()
    save_family("qwen3", tmp_path, 256)
    qwen3, _ = load_model(resolve_model(str(tmp_path)), torch.float32, quantization="int8")
    assert qwen3.fused is None and "family options" in qwen3.choose_decode_path()
    from types import SimpleNamespace as NS
    model, _ = load_model(resolve_model(tiny_llama), torch.float32, quantization="int8", int8_act=True)
    packed_up_to(model)
    try:
        for var, off in (("PAGEDSERVE_FUSED_DECODE", "0"), ("PAGEDSERVE_LAYER_OPS", "torch")):
            monkeypatch.setenv(var, off)
            assert model.choose_decode_path() == f"decode steps: layer by layer ({var}={off})"
            assert model.fused is None
            monkeypatch.delenv(var)
    finally:
        model.choose_layer_path()
        model.choose_decode_path()
    assert model.fused is not None
    runner = ModelRunner(model, num_blocks=10, block_size=16)
    prompt = make_request("p", list(range(40)))
    from pagedserve.core.step import ScheduledSeq, SchedulerOutput, whole
    so = SchedulerOutput((ScheduledSeq.of(prompt, 0, 40, whole((blocks_for(1, 40, 16),)), False),))
    x = torch.zeros(40, model.cfg.hidden_size)
    runner.batch.update(so)
    _, _, md, *_ = runner.prepare(so)
    from dataclasses import replace
    assert model.fused.takes(x, replace(md, native_prefill=True), None)       # prefill rows: the native kernel
    assert not model.fused.takes(x, replace(md, native_prefill=False), None)  # ... not the layers' SDPA
    assert not model.fused.takes(x, replace(md, native_prefill=True), NS(segments=[(0, 40, 0)]))   # LoRA rows
    model.fused.max_rows = 39
    try:
        assert not model.fused.takes(x, replace(md, native_prefill=True), None)   # past the packed products
    finally:
        model.fused.max_rows = 64
    decode = make_request("d", list(range(41)))
    so = SchedulerOutput((ScheduledSeq.of(decode, 40, 1, whole((blocks_for(1, 41, 16),)), False),))
    runner.batch.update(so)
    _, _, md, *_ = runner.prepare(so)
    assert model.fused.takes(x[:1], md, None)
    lora = NS(segments=[], decode_slots=[0], slots=NS(dtype=torch.float32))
    assert model.fused.takes(x[:1], md, lora)                          # adapter decode rows: in C
    assert not model.fused.takes(x[:1], md, NS(**{**vars(lora), "slots": NS(dtype=torch.bfloat16)}))
    assert not model.fused.takes(x[:1], md, NS(**{**vars(lora), "decode_slots": []}))


def test_the_fused_steps_clocks_count_their_parts(tiny_llama):
    """profile(): the seconds in the products, the attention and the glue (bench/step_anatomy.py) grow with
    each fused step and stop when it is turned off; the numbers are unchanged by it."""
    model, _ = load_model(resolve_model(tiny_llama), torch.float32, quantization="int8", int8_act=True)
    packed_up_to(model)
    plain, _ = _decode_logits(model, torch.float32)
    model.fused.profile()
    try:
        timed, _ = _decode_logits(model, torch.float32)
        seconds = list(model.fused.seconds)
    finally:
        model.fused.profile(False)
    assert torch.equal(plain, timed)
    assert all(s > 0 for s in seconds) and model.fused.stack.prof is None


def test_engines_sharing_the_loaded_model_step_in_threads_at_once(tiny_llama):
    """The loader's cache gives engines one model (and so one FusedDecode, whose structs hold the K/V
    planes' addresses): two runners decoding in two threads at once, in lock step, each get what they
    get alone; a runner's pool is not kept alive by the model once the runner is gone."""
    import gc
    import threading
    import weakref
    model, _ = load_model(resolve_model(tiny_llama), torch.float32, quantization="int8", int8_act=True)
    packed_up_to(model)
    alone = [_decode_logits(model, torch.float32, count=False, seed=s)[0] for s in (1, 2)]
    got = [None, None]

    def work(i):
        for _ in range(3):
            got[i] = _decode_logits(model, torch.float32, count=False, seed=1 + i)[0]
    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    runner = ModelRunner(model, num_blocks=40, block_size=16)
    pool = weakref.ref(runner.kv_cache)
    forward_all_rows(runner, [(make_request("x", list(range(20))), 0, 20, blocks_for(1, 20, 16))])
    forward_all_rows(runner, [(make_request("x", list(range(21))), 20, 1, blocks_for(1, 21, 16))])
    del runner
    gc.collect()
    assert pool() is None
