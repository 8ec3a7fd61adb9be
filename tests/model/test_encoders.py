"""Encoder embedding models (EncoderCore, model/bert.py) against sentence-transformers itself: tiny
random BertModel / XLMRobertaModel / MPNetModel saved by transformers, wrapped by sentence-transformers into its own
folder (modules.json, 1_Pooling, 2_Normalize) for each pooling mode; LLM.embed and /v1/embeddings equal
SentenceTransformer.encode within 1e-5 in float32, inputs of different lengths batched together (one
step packs them), inputs longer than max_seq_length truncated as sentence-transformers truncates."""
from __future__ import annotations

import httpx
import pytest
import torch

from pagedserve import LLM, EngineArgs, LLMEngine, PoolingParams
from pagedserve.errors import ParamError
from pagedserve.model.loader import ModelLoadError
from tests.entrypoints.helpers import serve_in_thread

st = pytest.importorskip("sentence_transformers")
MAX_SEQ = 24
TEXTS = ["w1 w2 w3", "w5", " ".join(f"w{i}" for i in range(40)),       # the third is truncated to MAX_SEQ
         "w100 w101 w17 w9", "w3 w3 w3 w3 w3 w3 w3"]


def _tokenizer(cls: str, sep: str, pad: str):
    """A WordPiece tokenizer made by tokenizers itself: "w0".."w199" and the special tokens, with the
    single-sequence template `cls $A sep` (BERT's [CLS] .. [SEP], XLM-R's <s> .. </s>)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    words = [pad, "[UNK]", cls, sep, "[MASK]"] + [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", special_tokens=[(cls, 2), (sep, 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token=pad, cls_token=cls,
                                   sep_token=sep, mask_token="[MASK]"), len(words)


def _base(d, arch: str) -> str:
    """The transformers model (random, seeded) and its tokenizer saved in d/hf."""
    import transformers as tf
    torch.manual_seed(0)
    if arch == "bert":
        tok, V = _tokenizer("[CLS]", "[SEP]", "[PAD]")
        m = tf.BertModel(tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, max_position_embeddings=64, type_vocab_size=2))
    elif arch == "mpnet":                           # relative position bias; no token types
        tok, V = _tokenizer("<s>", "</s>", "<pad>")
        m = tf.MPNetModel(tf.MPNetConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, pad_token_id=0, max_position_embeddings=66))
    else:
        tok, V = _tokenizer("<s>", "</s>", "<pad>")
        m = tf.XLMRobertaModel(tf.XLMRobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=4, intermediate_size=64, pad_token_id=0,
                                                   max_position_embeddings=66, type_vocab_size=1))
    path = str(d / "hf")
    m.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _folder(d, base: str, pooling: str, normalize: bool = True) -> str:
    """A sentence-transformers folder made by sentence-transformers: Transformer, Pooling(mode), Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    mods = [models.Transformer(base, max_seq_length=MAX_SEQ), models.Pooling(32, pooling_mode=pooling)]
    if normalize:
        mods.append(models.Normalize())
    out = d / f"st_{pooling}_{normalize}"
    SentenceTransformer(modules=mods, device="cpu").save(str(out))
    return str(out)


@pytest.fixture(scope="module", params=["bert", "xlm-roberta", "mpnet"])
def base(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return d, _base(d, request.param)


def _reference(path: str, texts=TEXTS) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_tensor=True, batch_size=2)


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", True), ("max", True), ("lasttoken", True),
                                               ("mean", False)])
def test_llm_embed_equals_sentence_transformers(base, pooling, normalize):
    d, hf = base
    path = _folder(d, hf, pooling, normalize)
    ref = _reference(path)
    with LLM(path, dtype="float32", max_num_batched_tokens=256) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
        assert llm.engine.core.counters.steps == 1            # all five packed into one step
        got = torch.tensor([o.outputs.embedding for o in outs])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        assert max(len(o.prompt_token_ids) for o in outs) == MAX_SEQ
        assert not llm.engine.core.kv_cache_bytes


def test_small_steps_and_pooling_override(base):
    d, hf = base
    path = _folder(d, hf, "mean")
    with LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=2) as llm:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        torch.testing.assert_close(got, _reference(path), atol=1e-5, rtol=0)
        assert llm.engine.core.counters.steps >= 3
        cls = llm.embed(TEXTS, PoolingParams(pooling_type="cls"), use_tqdm=False)
        torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in cls]),
                                   _reference(_folder(d, hf, "cls")), atol=1e-5, rtol=0)
        with pytest.raises(ParamError) as e:
            llm.generate("w1 w2")
        assert e.value.param == "model"
        assert not llm.engine.states and llm.engine.held() == {"engine.states": 0, "encoder.queue": 0}
        # an embedding aborted while queued leaves the queue, and the steps after it embed the others only
        eng = llm.engine
        gone, kept = (eng.add_request(None, t, PoolingParams()) for t in TEXTS[:2])
        assert eng.abort(gone).finished and eng.held()["encoder.queue"] == 1
        done = []
        while eng.has_unfinished_requests():
            done += eng.step()
        assert [o.request_id for o in done] == [kept] and eng.held() == {"engine.states": 0, "encoder.queue": 0}


def test_v1_embeddings_over_http(base):
    d, hf = base
    path = _folder(d, hf, "mean")
    ref = _reference(path)
    engine = LLMEngine(EngineArgs(path, dtype="float32"))
    from pagedserve.entrypoints.server import build_app
    with serve_in_thread(build_app(engine, served_model_name="m")) as base_url:
        r = httpx.post(base_url + "/v1/embeddings", json={"model": "m", "input": TEXTS}, timeout=30)
        assert r.status_code == 200, r.text
        got = torch.tensor([e["embedding"] for e in r.json()["data"]])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        for route, body in (("/v1/completions", {"prompt": "w1"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]})):
            r = httpx.post(base_url + route, json={"model": "m", "max_tokens": 2, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        r = httpx.post(base_url + "/v1/embeddings", json={"model": "m", "input": [[500]]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert not engine.states


def test_unsupported_architecture_is_refused(tmp_path):
    import json
    import transformers as tf
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    tok, V = _tokenizer("[CLS]", "[SEP]", "[PAD]")
    m = tf.DistilBertModel(tf.DistilBertConfig(vocab_size=V, dim=32, n_layers=1, n_heads=4, hidden_dim=64))
    m.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    SentenceTransformer(modules=[models.Transformer(str(tmp_path / "hf")), models.Pooling(32)],
                        device="cpu").save(str(tmp_path / "st"))
    assert json.loads((tmp_path / "st" / "config.json").read_text())["architectures"] == ["DistilBertModel"]
    with pytest.raises(ModelLoadError, match="architectures"):
        LLM(str(tmp_path / "st"), dtype="float32")
