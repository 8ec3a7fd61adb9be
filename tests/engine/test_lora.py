"""Multi-LoRA against PEFT on the same weights: random models saved by transformers, adapters made and
saved by PEFT itself (random A and B, init_lora_weights=False), and the reference for each adapter
PEFT's merged model (merge_and_unload) run by HF. Rows of several adapters and of the base model
share each step; the prefix cache never gives one adapter's KV to another; max_loras bounds the
adapters of a step; bad adapters and names are refused naming the field; the server picks the
adapter by `model`, lists adapters and loads / unloads them at run time (the openai SDK itself)."""
from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.errors import ParamError
from tests.entrypoints.helpers import serve_in_thread
from tests.model.families import save_family
from tests.model.helpers import assert_greedy_match, hf_greedy, packed_up_to

peft = pytest.importorskip("peft")      # pinned in the test extra: `make test` installs it

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
GO_ON = {"ignore_eos": True}


def _adapter(hf, d, targets, r: int, seed: int, rslora: bool = False, **config):
    """A PEFT adapter of random weights over hf, saved in d; returns PEFT's merged model."""
    torch.manual_seed(seed)
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                                init_lora_weights=False, use_rslora=rslora, **config))
    pm.save_pretrained(d)
    return pm.merge_and_unload().eval()


def _family(tmp_path_factory, tokenizer, name: str, attn_targets: list[str]):
    d = tmp_path_factory.mktemp(name)
    hf = save_family(name, d / "base", len(tokenizer), tokenizer)
    a = _adapter(hf, d / "A", attn_targets, 8, 1, alpha_pattern={attn_targets[-1]: 5})
    b = _adapter(hf, d / "B", "all-linear", 16, 2, rslora=True)
    return d, {None: hf, "A": a, "B": b}


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer):
    return _family(tmp_path_factory, tokenizer, "llama", ["q_proj", "v_proj"])


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 30, 70)]


def _lora(d, name):
    return None if name is None else LoRARequest(name, 1 if name == "A" else 2, str(d / name))


def _check_mixed_batch(d, models, **engine):
    """Every prompt under the base model and both adapters, all in one generate call (one step runs rows
    of all three): each equal to HF on PEFT's merged model."""
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=2, dtype="float32", num_kv_blocks=256, **engine)
    steps = []
    schedule = llm.engine.core.scheduler.schedule

    def spy():
        so = schedule()
        steps.append({s.lora_id for s in so.seqs})
        return so
    llm.engine.core.scheduler.schedule = spy
    prompts = _prompts(models[None].config.vocab_size)
    names = [None, "A", "B"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in names], GREEDY, use_tqdm=False,
                        lora_request=[_lora(d, n) for _ in prompts for n in names])
    assert max(len(ids) for ids in steps) == 3, "base and both adapters share a step"
    got = {}
    for i, (p, n) in enumerate((p, n) for p in prompts for n in names):
        ref, lps = hf_greedy(models[n], p, GREEDY.max_tokens)
        got[i] = outs[i].outputs[0].token_ids
        assert_greedy_match(got[i], ref, lps)
    assert any(got[3 * j] != got[3 * j + 1] for j in range(len(prompts))), "adapter A changes the output"
    assert any(got[3 * j] != got[3 * j + 2] for j in range(len(prompts))), "adapter B changes the output"
    assert all(v == 0 for v in llm.engine.held().values())
    return llm


def test_adapters_and_base_in_one_step_equal_peft_merged(llama):
    """Llama (the native float32 layer path): q/v adapter of rank 8, an all-linear rslora adapter of 16."""
    d, models = llama
    _check_mixed_batch(d, models)


def test_adapter_rows_of_packed_weights_in_the_fused_decode_step(llama):
    """Packed weights (quantization int8): decode steps with adapter rows beside base rows take the one
    native call (model.fused, the LoRA deltas added in C after each product), and give what the layer
    path gives (LoRABatch.add): the same greedy tokens or, at a near-tie, each in the other's top 5; the
    logprobs of the tokens both chose within 1e-4."""
    d, models = llama
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=2, dtype="float32", quantization="int8",
              num_kv_blocks=256, enable_prefix_caching=False)
    model = llm.engine.core.model
    assert packed_up_to(model).startswith("decode steps: every layer in one native call")
    prompts, names = _prompts(models[None].config.vocab_size), [None, "A", "B"]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)

    def generate():
        return llm.generate([{"prompt_token_ids": p} for p in prompts for _ in names], sp, use_tqdm=False,
                            lora_request=[_lora(d, n) for _ in prompts for n in names])
    fused, run, adapted = model.fused, model.fused.run, []
    fused.run = lambda x, pos, kv, md, lora=None: adapted.append(lora is not None) or run(x, pos, kv, md, lora)
    try:
        a = generate()
    finally:
        del fused.run
    assert any(adapted), "decode steps with adapter rows took the fused call"
    model.fused = None
    try:
        b = generate()
    finally:
        model.fused = fused
    for x, y in zip(a, b):
        xa, yb = x.outputs[0], y.outputs[0]
        for i, (s, t) in enumerate(zip(xa.token_ids, yb.token_ids)):
            if s != t:
                assert s in yb.logprobs[i] and t in xa.logprobs[i]
                break
            assert abs(xa.logprobs[i][s].logprob - yb.logprobs[i][s].logprob) < 1e-4
    assert sum(x.outputs[0].token_ids != y.outputs[0].token_ids for x, y in zip(a, b)) <= 1
    assert all(v == 0 for v in llm.engine.held().values())


def test_an_adapted_rows_fused_deltas_do_not_depend_on_the_rows_beside_it(llama):
    """lora_add groups a step's rows by adapter and takes up to 4 of them per pass over A and B (a short
    group repeats its last row, computed and not stored): each row must get its own adapter's delta
    wherever it lands. One adapted request alone, then the same request among 9 others (5 on its adapter,
    2 on the other, 2 on the base model): the same tokens, and logprobs within 1e-5 (not bit for bit: the
    packed products with int8-rounded activations already differ in the last bits between 1 and 10 rows,
    adapters or not; a row given another row's or adapter's delta moves them by far more)."""
    d, models = llama
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=2, dtype="float32", quantization="int8",
              num_kv_blocks=256, enable_prefix_caching=False, max_num_seqs=16)
    model = llm.engine.core.model
    assert packed_up_to(model, 16).startswith("decode steps: every layer in one native call")
    head, head_rows = model.embed_tokens.weight, getattr(model.embed_tokens.weight, "small_m", None)
    if head_rows is not None:           # the packed LM head too: one kernel for 1 and for 10 rows
        head.small_m = 16
    prompts = _prompts(models[None].config.vocab_size)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    fused, run, rows = model.fused, model.fused.run, []
    fused.run = lambda x, pos, kv, md, lora=None: rows.append(x.shape[0]) or run(x, pos, kv, md, lora)
    try:
        alone = llm.generate({"prompt_token_ids": prompts[1]}, sp, use_tqdm=False, lora_request=_lora(d, "B"))[0]
        names = ["B", "A", "B", None, "B", "B", "A", "B", None, "B"]
        crowd = llm.generate([{"prompt_token_ids": prompts[i % 3][: 20 + i]} if i != 5 else
                              {"prompt_token_ids": prompts[1]} for i in range(len(names))], sp, use_tqdm=False,
                             lora_request=[_lora(d, n) for n in names])[5]
    finally:
        del fused.run
        if head_rows is not None:
            head.small_m = head_rows
    assert max(rows) == len(names), "the crowded decode steps took the fused call"
    a, b = alone.outputs[0], crowd.outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


@pytest.mark.parametrize("family,targets", [("phi3", ["qkv_proj"]), ("gemma2", ["q_proj", "k_proj"])])
def test_other_families_equal_peft_merged(tmp_path_factory, tokenizer, family, targets):
    """Phi-3's checkpoints fuse qkv and gate_up as we do (PEFT adapts the fused modules); Gemma 2 runs the
    torch layer path (soft-caps, sandwich norms)."""
    d, models = _family(tmp_path_factory, tokenizer, family, targets)
    _check_mixed_batch(d, models)


def test_prefix_cache_is_keyed_by_adapter(llama):
    """The same prompt under the base model, then A, then A again: A never reads the base model's
    cached KV (its tokens stay PEFT's), and A's second run hits A's own blocks."""
    d, models = llama
    llm = LLM(str(d / "base"), enable_lora=True, dtype="float32", num_kv_blocks=256, block_size=16)
    p = _prompts(models[None].config.vocab_size)[2]               # 70 tokens: 4 full blocks
    base = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]
    first = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=_lora(d, "A"))[0]
    again = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=_lora(d, "A"))[0]
    ref, lps = hf_greedy(models["A"], p, GREEDY.max_tokens)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 64
    for out in (first, again):
        assert_greedy_match(out.outputs[0].token_ids, ref, lps)
    assert base.outputs[0].token_ids != first.outputs[0].token_ids


def test_max_loras_bounds_the_adapters_of_a_step(llama):
    """max_loras 1: requests of A and B interleaved with base ones all finish equal to PEFT, and no
    step runs both adapters (base rows run beside either)."""
    d, models = llama
    llm = LLM(str(d / "base"), enable_lora=True, max_loras=1, dtype="float32", num_kv_blocks=256)
    steps = []
    schedule = llm.engine.core.scheduler.schedule

    def spy():
        so = schedule()
        steps.append({s.lora_id for s in so.seqs} - {0})
        return so
    llm.engine.core.scheduler.schedule = spy
    prompts = _prompts(models[None].config.vocab_size)
    names = ["A", None, "B", "A", "B"]
    outs = llm.generate([{"prompt_token_ids": prompts[i % 3]} for i in range(len(names))], GREEDY, use_tqdm=False,
                        lora_request=[_lora(d, n) for n in names])
    assert max(len(s) for s in steps) == 1
    assert {i for s in steps for i in s} == {1, 2}
    for i, n in enumerate(names):
        ref, lps = hf_greedy(models[n], prompts[i % 3], GREEDY.max_tokens)
        assert_greedy_match(outs[i].outputs[0].token_ids, ref, lps)
    assert all(v == 0 for v in llm.engine.held().values())


def test_bad_adapters_are_refused_naming_the_field(llama, tmp_path, tokenizer):
    d, models = llama
    base = str(d / "base")
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(base, enable_lora=True, max_lora_rank=8, lora_modules=[f"B={d / 'B'}"], dtype="float32", num_kv_blocks=64)
    emb = tmp_path / "emb"
    _adapter(models[None], emb, ["q_proj", "embed_tokens"], 4, 3)
    with pytest.raises(ValueError, match="lora_modules: .*embed_tokens"):
        LLM(base, enable_lora=True, lora_modules={"emb": str(emb)}, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="lora_modules: .*not a PEFT adapter folder"):
        LLM(base, enable_lora=True, lora_modules=[f"x={tmp_path}"], dtype="float32", num_kv_blocks=64)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": "x"}')
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="lora_modules: .*adapter_config.json cannot be read"):
        LLM(base, enable_lora=True, lora_modules=[f"x={broken}"], dtype="float32", num_kv_blocks=64)
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    with pytest.raises(ValueError, match="lora_modules: .*adapter_model.safetensors cannot be read"):
        LLM(base, enable_lora=True, lora_modules=[f"x={broken}"], dtype="float32", num_kv_blocks=64)
    for bad, field in (({"lora_modules": ["noequals"]}, "lora_modules"), ({"lora_modules": ["a=/x"]}, "lora_modules"),
                       ({"enable_lora": True, "tensor_parallel_size": 2}, "enable_lora"),
                       ({"enable_lora": True, "max_loras": 0}, "max_loras"),
                       ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(model=base, **bad)
    llm = LLM(base, enable_lora=True, lora_modules=[f"A={d / 'A'}"], dtype="float32", num_kv_blocks=64)
    for lora, what in ((LoRARequest("nope"), "no adapter named 'nope'"),
                       (LoRARequest("A", 1, str(d / "B")), "is loaded from"),
                       (LoRARequest("C", 3, str(tmp_path)), "not a PEFT adapter folder")):
        with pytest.raises(ParamError, match=what) as e:
            llm.generate("hi", GREEDY, use_tqdm=False, lora_request=lora)
        assert e.value.param == "lora_request"
    plain = LLM(base, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ParamError, match="lora_request: this engine runs without LoRA"):
        plain.generate("hi", GREEDY, use_tqdm=False, lora_request=_lora(d, "A"))
    assert all(v == 0 for e in (llm.engine, plain.engine) for v in e.held().values())


def test_moe_experts_are_refused_attention_adapters_run(tmp_path, tokenizer):
    """Qwen3-MoE: an adapter of the attention runs (equal to PEFT); one of the experts is refused."""
    hf = save_family("qwen3_moe", tmp_path / "base", len(tokenizer), tokenizer)
    merged = _adapter(hf, tmp_path / "attn", ["q_proj", "o_proj"], 8, 1)
    llm = LLM(str(tmp_path / "base"), enable_lora=True, lora_modules=[f"attn={tmp_path / 'attn'}"], dtype="float32",
              num_kv_blocks=64)
    p = _prompts(hf.config.vocab_size)[1]
    out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=LoRARequest("attn"))[0]
    ref, lps = hf_greedy(merged, p, GREEDY.max_tokens)
    assert_greedy_match(out.outputs[0].token_ids, ref, lps)
    _adapter(hf, tmp_path / "mlp", ["gate_proj", "up_proj"], 4, 2)     # PEFT adapts the fused experts module
    with pytest.raises(ValueError, match=r"lora_path: .*mlp\.experts\.lora_[AB].*mixture-of-experts layers are not"):
        llm.engine.core.loras.load("mlp", str(tmp_path / "mlp"))


def test_served_adapters_with_the_openai_sdk(llama):
    """`model` picks the adapter (same tokens as offline); /v1/models lists the adapters; an unknown name
    is a 404 naming `model`; adapters load and unload at run time, and a stream in flight when its
    adapter is unloaded finishes with it."""
    from pagedserve.entrypoints.server import build_app
    from pagedserve.engine.llm_engine import LLMEngine
    d, models = llama
    prompt = _prompts(models[None].config.vocab_size)[1]
    offline = {}
    for n in ("A", "B"):
        ref, _ = hf_greedy(models[n], prompt, 8)
        offline[n] = ref
    eng = LLMEngine(EngineArgs(model=str(d / "base"), enable_lora=True, max_loras=2, dtype="float32",
                               num_kv_blocks=256, lora_modules=[f"A={d / 'A'}"]))
    app = build_app(eng, served_model_name="base")
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        ids = [m.id for m in client.models.list().data]
        assert ids == ["base", "A"]
        r = client.completions.create(model="A", prompt=prompt, max_tokens=8, temperature=0, extra_body=GO_ON)
        assert r.usage.completion_tokens == 8 and r.choices[0].text == eng.tokenizer.decode(offline["A"])
        assert r.model == "A"            # the adapter's name, as vLLM answers
        assert client.completions.create(model="base", prompt=prompt, max_tokens=2).model == "base"
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="B", prompt=prompt, max_tokens=4)
        assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
        assert "`B` does not exist" in e.value.body["message"] and "base, A" in e.value.body["message"]
        r = httpx.post(url + "/tokenize", json={"model": "B", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert httpx.post(url + "/tokenize", json={"model": "A", "prompt": "hi"}).status_code == 200
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": str(d / "B")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "B", "lora_path": str(d / "B")})
        assert r.status_code == 200 and "B" in r.text
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "B", "lora_path": str(d / "B")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        for bad in (str(d), str(d / "base")):                # not an adapter folder; a model folder
            r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "C", "lora_path": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        out = client.completions.create(model="B", prompt=prompt, max_tokens=8, temperature=0, extra_body=GO_ON)
        assert out.choices[0].text == eng.tokenizer.decode(offline["B"])
        chat = client.chat.completions.create(model="B", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].finish_reason == "length" and chat.model == "B"
        # unloading while a stream of B runs: the stream finishes; B's later requests are 404s
        stream = client.completions.create(model="B", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                           extra_body=GO_ON)
        first = next(iter(stream))
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "B"})
        assert r.status_code == 200
        text = first.choices[0].text + "".join(c.choices[0].text for c in stream if c.choices)
        assert text.startswith(eng.tokenizer.decode(offline["B"]))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="B", prompt=prompt, max_tokens=4)
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "B"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        assert [m.id for m in client.models.list().data] == ["base", "A"]
        held = httpx.get(url + "/debug/scheduler").json()["held"]
        assert all(v == 0 for v in held.values()), held
    assert eng.core.runner.lora.adapters.keys() == {eng.core.loras.get("A").lora_id}, "B's weights were dropped"


def test_cli_flags_are_vllms(llama):
    from pagedserve.entrypoints.cli import build_parser
    d, _ = llama
    ns = build_parser().parse_args(["serve", str(d / "base"), "--enable-lora", "--lora-modules", f"A={d / 'A'}",
                                    json.dumps({"name": "B", "path": str(d / "B")}), "--max-loras", "2",
                                    "--max-lora-rank", "16"])
    args = EngineArgs.from_cli_args(ns)
    assert args.enable_lora and args.max_loras == 2 and args.max_lora_rank == 16
    from pagedserve.lora_request import parse_lora_modules
    assert parse_lora_modules(args.lora_modules) == {"A": str(d / "A"), "B": str(d / "B")}


def test_masked_and_grouped_products_equal_each_rows_own_delta(llama):
    """LoRABatch.add against the textbook formula row by row: decode rows (masked over the slots they
    use) and prefill runs (each by its own slot), base rows untouched, every product of every layer."""
    from pagedserve.model.loader import read_model_config, resolve_model
    from pagedserve.model.lora import LoRASlots, read_adapter
    d, _ = llama
    cfg = read_model_config(resolve_model(str(d / "base")))
    weights = {1: read_adapter(str(d / "A"), cfg, 16), 2: read_adapter(str(d / "B"), cfg, 16)}
    slots = LoRASlots(cfg, 2, 16, torch.float32, "cpu")
    for i, w in weights.items():
        slots.add(i, w)
    g = torch.Generator().manual_seed(0)
    # decode rows of both adapters (every slot read), then prefill runs; then decode rows of adapter 1 only
    # (its slot, the first, alone read)
    for rows, num_decode in (([1, 0, 2, 2, 0, 0, 1, 1, 1, 2, 2, 0], 4), ([1, 0, 1, 2, 2], 3)):
        _check_rows(slots, weights, cfg, rows, num_decode, g)


def _check_rows(slots, weights, cfg, rows, num_decode, g):
    from pagedserve.model.lora import product_shapes
    with torch.inference_mode():
        batch = slots.batch(rows, num_decode)
        for layer in range(cfg.num_layers):
            for product, (inp, outs) in product_shapes(cfg).items():
                x = torch.randn(len(rows), inp, generator=g)
                y0 = torch.randn(len(rows), sum(outs), generator=g)
                want = y0.clone()
                for r, lid in enumerate(rows):
                    for p in (q for q in (weights[lid].parts if lid else ())
                              if (q.layer, q.product) == (layer, product)):
                        first = sum(outs[:p.part]) if p.part is not None else 0
                        delta = (x[r] @ p.a.T) @ p.b.T
                        want[r, first:first + delta.shape[0]] += delta
                got = batch.add(y0.clone(), x, layer, product)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_loading_adapters_keeps_no_python_objects(llama):
    """Adapters loaded and dropped again and again (a server's /v1/load_lora_adapter) leave nothing behind:
    safetensors 0.8's safe_open kept ~55 bytes per tensor per file opened (23 KB per adapter here)."""
    import gc
    import tracemalloc
    from pagedserve.model.loader import read_model_config, resolve_model
    from pagedserve.model.lora import read_adapter
    d, _ = llama
    cfg = read_model_config(resolve_model(str(d / "base")))
    for _ in range(5):
        read_adapter(str(d / "B"), cfg, 16)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(50):
            read_adapter(str(d / "B"), cfg, 16)
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 20_000, f"{grown} bytes of Python objects kept by 50 adapter loads"
