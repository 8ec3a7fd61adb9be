"""GGUF files in the per-tensor type mixes llama-quantize writes (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M), for
Llama, Qwen2 and Gemma 3 shapes, written with the gguf package's writer. gguf-py quantizes only the
simple types, so each tensor is random valid blocks of its type with its f16 scale fields set so that
the weights have a chosen spread: the model is whatever the file holds, and the references are that
file dequantized by the gguf package."""
from __future__ import annotations

import numpy as np

# where each type's f16 scale fields lie in its block (d, and dmin where there is one); every type is
# linear in them, so setting them all to c scales every weight by c
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}

# llama-quantize's choices (llama_tensor_get_type, simplified to what these files exercise): attn_v and
# ffn_down take more bits in the "use_more_bits" layers; a type whose blocks do not divide the row
# (K % 256) falls back as llama.cpp does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q3_K -> IQ4_NL)
RECIPES = {
    "Q4_K_M": dict(base="Q4_K", more="Q6_K", output="Q6_K", embd="Q4_K"),
    "Q5_K_M": dict(base="Q5_K", more="Q6_K", output="Q6_K", embd="Q5_K"),
    "Q6_K": dict(base="Q6_K", more="Q6_K", output="Q6_K", embd="Q6_K"),
    "Q3_K_M": dict(base="Q3_K", more="Q5_K", output="Q6_K", embd="Q3_K", attn_output="Q4_K"),
}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q3_K": "IQ4_NL", "Q2_K": "Q4_0", "IQ4_XS": "IQ4_NL"}

# (arch, hidden, heads, kv heads, head dim, intermediate, layers): K multiples of 256 for the K-quants,
# with one row size (Qwen2's 320 intermediate) that takes the fallbacks, as the real 0.5B's 896 does
SHAPES = {
    "llama": dict(hidden=256, heads=4, kv=2, head_dim=64, inter=512, layers=3),
    "qwen2": dict(hidden=256, heads=4, kv=2, head_dim=64, inter=320, layers=3),
    "gemma3": dict(hidden=256, heads=4, kv=2, head_dim=64, inter=512, layers=3),
}
VOCAB = 512


def random_blocks(qtype: str, n: int, k: int, rng, std: float = 0.05) -> np.ndarray:
    """(n, row bytes) of valid `qtype` blocks whose dequantized weights have about this spread."""
    import gguf
    qt = gguf.GGMLQuantizationType[qtype]
    per, nbytes = gguf.GGML_QUANT_SIZES[qt]
    data = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    if qtype == "Q6_K":                                        # int8 scales: keep them moderate
        data[..., 192:208] = rng.integers(-40, 40, size=(n, k // per, 16)).astype(np.int8).view(np.uint8)
    one = np.ones((n, k // per), dtype=np.float16).view(np.uint8).reshape(n, k // per, 2)
    for off in F16_FIELDS[qtype]:
        data[..., off:off + 2] = one
    raw = data.reshape(n, -1)
    c = std / max(float(gguf.quants.dequantize(raw, qt).std()), 1e-12)
    scaled = (np.full((n, k // per), c) * rng.uniform(0.5, 1.5, size=(n, k // per))).astype(np.float16)
    for off in F16_FIELDS[qtype]:
        data[..., off:off + 2] = scaled.view(np.uint8).reshape(n, k // per, 2)
    return data.reshape(n, -1)


def _type_for(recipe: dict, tensor: str, layer: int, layers: int, k: int) -> str:
    more = layer < max(1, layers // 8) or layer >= layers - max(1, layers // 8) or (layer - layers // 8) % 3 == 2
    if tensor in ("attn_v", "ffn_down") and more:
        t = recipe["more"]
    elif tensor == "attn_output":
        t = recipe.get("attn_output", recipe["base"])
    else:
        t = recipe["base"]
    return FALLBACK.get(t, t) if k % 256 else t


def write_mix(path, arch: str, recipe_name: str, seed: int = 0) -> dict[str, str]:
    """The file, and each weight tensor's type as written."""
    import gguf
    s, recipe = SHAPES[arch], RECIPES[recipe_name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    if arch == "gemma3":
        w.add_sliding_window(32)
    types: dict[str, str] = {}

    def add(name: str, qtype: str, n: int, k: int, std: float = 0.05) -> None:
        if qtype == "F32":
            w.add_tensor(name, rng.normal(0, std, size=(n, k)).astype(np.float32))
        else:
            w.add_tensor(name, random_blocks(qtype, n, k, rng, std), raw_dtype=gguf.GGMLQuantizationType[qtype])
        types[name] = qtype

    def norm(name: str, width: int) -> None:
        base = 0.0 if arch == "gemma3" else 1.0    # llama.cpp's Gemma files carry (1 + w)
        w.add_tensor(name, (base + 1.0 + rng.normal(0, 0.05, size=width)).astype(np.float32))

    H, hd, I = s["hidden"], s["head_dim"], s["inter"]
    emb = recipe["embd"]
    add("token_embd.weight", FALLBACK.get(emb, emb) if H % 256 else emb, VOCAB, H, std=1.0)
    add("output.weight", recipe["output"], VOCAB, H, std=0.2)
    norm("output_norm.weight", H)
    for i in range(s["layers"]):
        b = f"blk.{i}."
        for name, n, k in (("attn_q", s["heads"] * hd, H), ("attn_k", s["kv"] * hd, H), ("attn_v", s["kv"] * hd, H),
                           ("attn_output", H, s["heads"] * hd), ("ffn_gate", I, H), ("ffn_up", I, H),
                           ("ffn_down", H, I)):
            add(b + name + ".weight", _type_for(recipe, name, i, s["layers"], k), n, k)
        if arch == "qwen2":
            for name, n in (("attn_q", s["heads"] * hd), ("attn_k", s["kv"] * hd), ("attn_v", s["kv"] * hd)):
                w.add_tensor(b + name + ".bias", rng.normal(0, 0.05, size=n).astype(np.float32))
        norm(b + "attn_norm.weight", H)
        norm(b + "ffn_norm.weight", H)
        if arch == "gemma3":
            norm(b + "post_attention_norm.weight", H)
            norm(b + "post_ffw_norm.weight", H)
            norm(b + "attn_q_norm.weight", hd)
            norm(b + "attn_k_norm.weight", hd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types
