"""The safetensors path: a random-initialised Llama with GQA and untied embeddings matches HF."""
import pytest
import torch

from pagedserve.model.loader import load_model, resolve_model
from pagedserve.runner.model_runner import ModelRunner
from tests.model.helpers import assert_greedy_match, blocks_for, forward_all_rows, hf_greedy, make_request


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():   # a sharper distribution than the default init, so greedy is meaningful
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    d = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(d, safe_serialization=True)
    model, mcfg = load_model(resolve_model(str(d)))
    return hf, model, mcfg


def test_config_read_from_folder(tiny):
    _, _, cfg = tiny
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (8, 2, 16, False)


def test_prefill_logits_match_hf(tiny):
    hf, model, _ = tiny
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = ModelRunner(model, num_blocks=40, block_size=16)
    ours = forward_all_rows(runner, [(make_request("a", ids), 0, 300, blocks_for(1, 300, 16))])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_matches_hf(tiny):
    hf, model, _ = tiny
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler import ScheduledSeq, SchedulerOutput
    from pagedserve.core.step import whole
    from pagedserve.sampling_params import SamplingParams
    for seed, plen in [(2, 5), (3, 40), (4, 120)]:
        prompt = torch.randint(0, 512, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref, ref_lp = hf_greedy(hf, prompt, 32)
        runner = ModelRunner(model, num_blocks=20, block_size=16)
        req = Request("r", prompt, SamplingParams(max_tokens=32), max_tokens=32)
        blocks = blocks_for(1, plen + 32, 16)
        start, n = 0, plen
        for _ in range(32):
            out = runner.execute(SchedulerOutput(seqs=(ScheduledSeq.of(req, start, n, whole((blocks,)), True),)))
            req.append_token(out.sampled["r"][0].token_id)
            start, n = start + n, 1
        assert_greedy_match(req.output_token_ids, ref, ref_lp)


def _roundtrip(tmp_path, hf):
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load_model(resolve_model(str(tmp_path)))
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    runner = ModelRunner(model, num_blocks=20, block_size=16)
    ours = forward_all_rows(runner, [(make_request("a", ids), 0, 200, blocks_for(1, 200, 16))])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    return (ours - ref).abs().max().item()


def test_qwen2_style_qkv_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, 0.5)          # non-zero biases, so the test sees them
    assert _roundtrip(tmp_path, hf) < 1e-3


def test_llama3_rope_scaling(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    hf = LlamaForCausalLM(cfg).eval()
    assert _roundtrip(tmp_path, hf) < 1e-3
