"""The native float32 layer glue (kernels/layer_ops.c: RMSNorm with the residual add, RoPE with the K/V
write, SiLU x up) against the torch code it replaces, at every ISA level this host runs; and a whole
model on it against the same model on torch ops and against HF."""
import pytest
import torch
import torch.nn.functional as F

from pagedserve import kernels
from pagedserve.model.attention import LayerKV, write_kv
from pagedserve.model.llama import apply_rope, rms_norm
from pagedserve.model.loader import load_model, resolve_model
from pagedserve.runner.model_runner import ModelRunner
from tests.model.helpers import blocks_for, forward_all_rows, make_request

LEVELS = kernels.host_levels()


@pytest.fixture(params=LEVELS)
def lib(request):
    lib = kernels.load(request.param, source="layer_ops")
    assert lib is not None and lib.layer_ops_isa().decode() == request.param
    return lib


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("T,H", [(1, 576), (3, 100), (9, 576), (40, 48)])      # 9, 40: split over threads
def test_add_rms_norm_is_torchs(lib, T, H):
    g = torch.Generator().manual_seed(T)
    x, y, w = torch.randn(T, H, generator=g) * 3, torch.randn(T, H, generator=g), torch.randn(H, generator=g)
    r, out = kernels.add_rms_norm(x, w, 1e-5, lib=lib)
    assert r is x
    _close(out, rms_norm(x, w, 1e-5))
    x0 = x.clone()
    r, out = kernels.add_rms_norm(x, w, 1e-6, y, lib=lib)
    assert torch.equal(x, x0), "the caller's residual is not written"
    torch.testing.assert_close(r, x + y, rtol=0, atol=0)
    _close(out, rms_norm(x + y, w, 1e-6))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("hd,rot", [(64, 64), (64, 48), (16, 0), (96, 96)])     # 48: partial RoPE; 0: NoPE
@pytest.mark.parametrize("T", [1, 11])
def test_rope_kv_is_apply_rope_then_write_kv(lib, kv_dtype, hd, rot, T):
    nh, nkv, nb, bs = 6, 2, 8, 4
    g = torch.Generator().manual_seed(hd + rot + T)
    qkv = torch.randn(T, (nh + 2 * nkv) * hd + 8, generator=g)[:, : (nh + 2 * nkv) * hd]    # a row stride > width
    ang = torch.rand(T, 1, rot // 2, generator=g) * 50
    cos, sin = (torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()) if rot else (None, None)
    slots = torch.randperm(nb * bs, generator=g)[:T].long()

    def cache():
        k, v = (torch.zeros(nb, bs, nkv, hd, dtype=kv_dtype) for _ in range(2))
        s = (torch.zeros(nb, bs, nkv), torch.zeros(nb, bs, nkv)) if kv_dtype == torch.int8 else ()
        return LayerKV(k, v, *s)
    ref_kv, got_kv = cache(), cache()
    qk = qkv[:, : (nh + nkv) * hd].reshape(T, nh + nkv, hd)
    qk = apply_rope(qk, cos, sin) if rot else qk
    write_kv(ref_kv, qk[:, nh:], qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd), slots)
    q = kernels.rope_kv(qkv, cos, sin, got_kv.k, got_kv.v, got_kv.k_scale, got_kv.v_scale, slots, nh, nkv, hd, lib=lib)
    assert q.shape == (T, nh, hd) and q.is_contiguous()
    _close(q, qk[:, :nh])
    for a, b in ((got_kv.k, ref_kv.k), (got_kv.v, ref_kv.v)):
        if kv_dtype == torch.int8:     # a rounding tie may land one step apart
            assert (a.int() - b.int()).abs().max() <= 1
        else:
            _close(a.float(), b.float())
    if kv_dtype == torch.int8:
        _close(got_kv.k_scale, ref_kv.k_scale)
        _close(got_kv.v_scale, ref_kv.v_scale)


@pytest.mark.parametrize("T,I", [(1, 1536), (9, 40)])
def test_silu_mul_is_torchs(lib, T, I):
    gu = torch.randn(T, 2 * I + 4, generator=torch.Generator().manual_seed(I))[:, : 2 * I] * 6
    gu[0, :8] = torch.tensor([-100.0, -30.0, -0.0, 0.0, 1e-8, 30.0, 100.0, -87.5])     # exp's edges, both signs
    g, u = gu.chunk(2, dim=-1)
    _close(kernels.silu_mul(gu, lib=lib), F.silu(g) * u)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, rms_norm_eps=1e-5)
    hf = LlamaForCausalLM(cfg).eval()
    d = tmp_path_factory.mktemp("tiny-llama-ops")
    hf.save_pretrained(d, safe_serialization=True)
    return hf, str(d)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_a_model_on_the_native_glue_computes_what_torch_does(tiny_llama, monkeypatch, kv_dtype):
    """Every layer of a float32 Llama takes the native path (the load log says so); its logits over a
    chunked prefill and decodes equal the torch path's to float32 rounding, and HF's."""
    hf, path = tiny_llama
    model, _ = load_model(resolve_model(path), torch.float32)
    assert all(layer.ops is not None for layer in model.layers)
    assert model.choose_layer_path().startswith("layer glue: native in 3 of 3 layers")
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    req, blocks = make_request("a", ids), blocks_for(1, 70, 16)

    def run():       # a 50-token chunk, then the last 20 on top of its cached K/V
        runner = ModelRunner(model, num_blocks=20, block_size=16, kv_cache_dtype=kv_dtype)
        return torch.cat([forward_all_rows(runner, [(req, 0, 50, blocks)]),
                          forward_all_rows(runner, [(req, 50, 20, blocks)])])
    native = run()
    monkeypatch.setenv("PAGEDSERVE_LAYER_OPS", "torch")
    assert model.choose_layer_path().startswith("layer glue: native in 0 of 3 layers (PAGEDSERVE_LAYER_OPS=torch)")
    try:
        torch_path = run()
    finally:
        monkeypatch.delenv("PAGEDSERVE_LAYER_OPS")
        model.choose_layer_path()
    tol = 1e-5 if kv_dtype == torch.float32 else 1e-3        # int8: a value at a rounding edge may step
    torch.testing.assert_close(native, torch_path, rtol=tol, atol=tol)
    if kv_dtype == torch.float32:
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (native - ref).abs().max().item() < 1e-3


def test_families_with_extra_norms_stay_on_torch(tmp_path):
    """A Qwen3 layer (per-head q/k norms) is not what layer_ops computes: it keeps the torch path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)).save_pretrained(tmp_path)
    model, _ = load_model(resolve_model(str(tmp_path)), torch.float32)
    assert all(layer.ops is None for layer in model.layers)
