"""The default model matches HF transformers on the same GGUF file, in fp32."""
import torch

from pagedserve import SamplingParams
from pagedserve.runner.model_runner import ModelRunner
from tests.model.helpers import assert_greedy_match, blocks_for, forward_all_rows, hf_greedy, make_request


def test_prefill_logits_match_hf_300_tokens(default_model, hf_model):
    model, cfg = default_model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(17, cfg.vocab_size, (300,), generator=g).tolist()
    runner = ModelRunner(model, num_blocks=40, block_size=16)
    ours = forward_all_rows(runner, [(make_request("a", ids), 0, 300, blocks_for(1, 300, 16))])
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_chat_tokens_match_hf(llm, hf_model, chat_prompt_ids):
    prompts = chat_prompt_ids[:8]
    assert len({len(p) for p in prompts}) >= 6          # prompts of different lengths
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy(hf_model, p, 32)
        assert len(out.outputs[0].token_ids) == 32
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_lp)


def test_gguf_packed_weights_match_hf(hf_model, chat_prompt_ids):
    """--quantization gguf multiplies the file's Q4_1 / Q8_0 blocks directly: the same weights HF
    dequantizes, so the logits differ only by summation order, and greedy tokens match HF fp32 under
    the near-tie rule of assert_greedy_match."""
    from pagedserve import LLM
    llm = LLM(num_kv_blocks=1024, dtype="float32", quantization="gguf")
    model = llm.engine.core.model
    assert model.weights_desc == "float32 packed Q4_1 x 120, Q8_0 x 1"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(17, model.cfg.vocab_size, (300,), generator=g).tolist()
    runner = ModelRunner(model, num_blocks=40, block_size=16)
    ours = forward_all_rows(runner, [(make_request("a", ids), 0, 300, blocks_for(1, 300, 16))])
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"gguf packed: largest logit difference to HF fp32 over 300 positions: {diff:.2e}")
    assert diff < 1e-3
    prompts = chat_prompt_ids[:8]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref_ids, ref_lp = hf_greedy(hf_model, p, 32)
        assert_greedy_match(out.outputs[0].token_ids, ref_ids, ref_lp)
