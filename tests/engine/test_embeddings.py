"""Embeddings (LLM.embed, /v1/embeddings) against transformers on the same weights: a Qwen3-shaped
random model saved by transformers with sentence-transformers' pooling files (last-token pooling and
a Normalize module, as Qwen3-Embedding ships), pooled LAST / MEAN / CLS from HF's last_hidden_state,
through chunked prefill, prefix-cache hits, preemption and a batch shared with generations."""
from __future__ import annotations

import base64
import json

import httpx

import numpy as np
import openai
import pytest
import torch

from pagedserve import LLM, PoolingParams, SamplingParams
from pagedserve.errors import ParamError
from tests.entrypoints.helpers import serve_in_thread
from tests.model.families import save_family


def _sentence_transformers_files(d, pooling: str = "lasttoken", normalize: bool = True) -> None:
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        mods.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (d / "modules.json").write_text(json.dumps(mods))
    (d / "1_Pooling").mkdir(exist_ok=True)
    modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("qwen3_embedding")
    hf = save_family("qwen3", d, len(tokenizer), tokenizer, sharpen=5.0)
    _sentence_transformers_files(d)
    return d, hf


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 7, 40, 90)]


def _hf(hf, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"LAST": h[-1], "CLS": h[0], "MEAN": h.mean(0)}[pooling]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def _close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pooling,normalize", [(None, None), ("MEAN", False), ("CLS", True), ("LAST", False)])
def test_embeddings_equal_transformers(model, pooling, normalize):
    """None: the model's own pooling (its sentence-transformers files: last token, normalized). Small
    chunks (16 tokens a step) so MEAN sums over several steps."""
    d, hf = model
    prompts = _prompts(hf.config.vocab_size)
    with LLM(str(d), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32,
             long_prefill_token_threshold=16) as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(pooling, normalize), use_tqdm=False)
        for p, o in zip(prompts, outs):
            _close(o.outputs.embedding, _hf(hf, p, pooling or "LAST", True if normalize is None else normalize))
        again = llm.embed([{"prompt_token_ids": prompts[3]}], PoolingParams(pooling, normalize), use_tqdm=False)
        _close(again[0].outputs.embedding, torch.tensor(outs[3].outputs.embedding))   # after a prefix hit (LAST)
        #                                                  or a recompute (MEAN, CLS: the cache is skipped)
        eng = llm.engine
        assert not eng.states and eng.core.kv.num_free_blocks == eng.core.kv.pool.num_usable_blocks


def test_embeddings_beside_generations_and_under_preemption(model):
    """Embedding requests share steps with generations (whose tokens stay those of a run alone) and
    survive preemption by recompute (MEAN: no position pooled twice)."""
    d, hf = model
    prompts = _prompts(hf.config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(d), dtype="float32", num_kv_blocks=64) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[2:]], sp,
                                                              use_tqdm=False)]
    # (a Qwen3 with sliding layers: a full and a window group, a block id spans half the layers)
    with LLM(str(d), dtype="float32", num_kv_blocks=30, block_size=8, max_num_batched_tokens=48,
             long_prefill_token_threshold=16) as llm:
        eng = llm.engine
        for i, p in enumerate(prompts[2:]):
            eng.add_request(f"g{i}", {"prompt_token_ids": p}, sp)
        for i, p in enumerate(prompts):
            eng.add_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams("MEAN", False))
        eng.add_request("cut", {"prompt_token_ids": max(prompts, key=len)}, PoolingParams("MEAN", False), priority=-1)
        done = {}
        while "cut" not in eng.core.runner.pool_sums:       # part of its prompt pooled (the runner's partial sum) ...
            eng.step()
        assert eng.abort("cut").outputs[0].finish_reason == "abort"     # ... then its client goes away
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        assert eng.core.counters.preemptions > 0, "the pool was meant to be too small"
        assert [done[f"g{i}"].outputs[0].token_ids for i in range(2)] == alone
        for i, p in enumerate(prompts):
            _close(done[f"e{i}"].embedding, _hf(hf, p, "MEAN", False))
        assert not eng.states and eng.core.kv.num_free_blocks == eng.core.kv.pool.num_usable_blocks
        assert not any(eng.held().values()), eng.held()         # the runner's partial sums included


def test_bad_pooling_is_a_value_error_naming_it(model):
    d, _ = model
    with pytest.raises(ParamError, match="pooling_type"):
        PoolingParams("WEIGHTEDMEAN")
    with pytest.raises(ParamError, match="dimensions"):
        PoolingParams(dimensions=0)
    with LLM(str(d), dtype="float32", num_kv_blocks=16) as llm:
        with pytest.raises(ParamError, match="dimensions: this model does not make 16-dimensional"):
            llm.embed("hi", PoolingParams(dimensions=16))      # not a matryoshka model
        with pytest.raises(ParamError, match="pooling 'MAX' is not supported for this model"):
            llm.embed("hi", PoolingParams("MAX"))              # an encoder's pooling (EncoderCore), not a decoder's
        assert not llm.engine.states


def test_unsupported_model_pooling_is_refused(tmp_path, tokenizer):
    """A model whose sentence-transformers pooling we do not implement (max) is a clear error, not
    another pooling; --pooling chooses one."""
    save_family("qwen3", tmp_path, len(tokenizer), tokenizer)
    _sentence_transformers_files(tmp_path, pooling="max_tokens")
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=16) as llm:
        with pytest.raises(ParamError, match="'MAX' is not supported"):
            llm.embed("hi")
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, pooling="mean") as llm:
        assert len(llm.embed("hi", use_tqdm=False)[0].outputs.embedding) == 64


def test_v1_embeddings_with_the_openai_sdk(model):
    d, hf = model
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(str(d), dtype="float32", num_kv_blocks=64))
    prompts = _prompts(hf.config.vocab_size)
    with serve_in_thread(build_app(engine, served_model_name="m")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = client.embeddings.create(model="m", input=prompts)
        assert [e.index for e in r.data] == [0, 1, 2, 3] and r.usage.prompt_tokens == sum(map(len, prompts))
        for p, e in zip(prompts, r.data):
            _close(e.embedding, _hf(hf, p, "LAST", True))
        raw = client.embeddings.with_raw_response.create(model="m", input="a text", encoding_format="base64")
        b64 = raw.http_response.json()["data"][0]["embedding"]
        floats = client.embeddings.create(model="m", input="a text").data[0].embedding
        assert np.frombuffer(base64.b64decode(b64), dtype="<f4").tolist() == pytest.approx(floats, abs=0)
        for body, param in (({"input": []}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),
                            ({"input": "x", "max_tokens": 4}, "max_tokens"), ({"input": [[-1]]}, "input"),
                            ({"input": [[5] * 600]}, "input")):            # longer than the context
            resp = httpx.post(base + "/v1/embeddings", json={"model": "m", **body}, timeout=30)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert not engine.states
