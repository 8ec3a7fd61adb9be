"""The model families we run, each stated as how it differs from Llama, and the rule that keeps a
model from loading and computing something else: every field of an HF config must be one this
family honours, one that cannot change inference (dropouts, ids, flags for training), or one held
at the only values we implement. Anything else is refused at load, naming the field.

A family's config.json is parsed by transformers' own config class (its defaults and its
back-compatibility conversions, e.g. `rope_scaling` -> `rope_parameters`, Gemma 3's layer pattern
-> `layer_types`), then walked field by field here and turned into our `ModelConfig`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedserve.model.config import ModelConfig


class UnsupportedModelError(ValueError):
    """A config this engine cannot compute exactly; the message names the architecture or field."""


# fields of every transformers config that do not change what inference computes
INERT = frozenset({
    "transformers_version", "architectures", "model_type", "_name_or_path", "dtype", "torch_dtype",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "use_cache", "initializer_range",
    "pad_token_id", "bos_token_id", "eos_token_id", "attention_dropout",      # (dropout: training only)
})
# the Llama shape every family reads
LLAMA_READS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_parameters",
})
# keys inside rope_parameters that rope.py computes (per rope type, see rope.inv_freq)
ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings", "short_factor", "long_factor", "attention_factor",
                       "partial_rotary_factor"})
ROPE_TYPES = ("default", "linear", "llama3", "longrope")

SILU = {"hidden_act": ("silu",)}
NO_MLP_BIAS = {"mlp_bias": (False,)}
WINDOW_LAYERS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
# vision-language models (model/vision.py): an image encoder beside a text model of a family here
VISION_MODEL_TYPES = ("llava", "idefics3", "smolvlm", "llava_next", "gemma3", "qwen2_5_vl")
ROUTER_TRAINING = frozenset({"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"})


@dataclass(frozen=True)
class Family:
    """`reads`: fields honoured at any valid value; `inert`: fields with no effect on inference;
    `only`: fields honoured only at the listed values; `differs(hf) -> ModelConfig fields`;
    `rope_reads`: rope_parameters fields this family reads beside ROPE_KEYS (Qwen2.5-VL's mrope_section)."""

    name: str
    architectures: tuple[str, ...]
    differs: Callable[[dict], dict]
    reads: frozenset[str] = frozenset()
    inert: frozenset[str] = frozenset()
    only: dict[str, tuple] = field(default_factory=dict)
    rope_reads: frozenset[str] = frozenset()

    def check(self, hf: dict) -> None:
        for key, value in hf.items():
            if key in INERT or key in LLAMA_READS or key in self.reads or key in self.inert:
                continue
            if key in self.only:
                if value not in self.only[key]:
                    raise UnsupportedModelError(
                        f"{self.name}: config field {key}={value!r} is not implemented (supported: "
                        f"{', '.join(map(repr, self.only[key]))})")
                continue
            raise UnsupportedModelError(f"{self.name}: config field {key!r} (= {_short(value)}) changes the model in "
                                        "a way this engine does not implement; refusing to load it")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 60 else s[:57] + "..."


# ---------------------------------------------------------------- how each family differs from Llama

def _windows(hf: dict) -> list[int] | None:
    """Per layer: 0 (full attention) or W (the last W positions). Families with layer_types say which
    layers slide; the others (Mistral, Mixtral, Phi-3) slide in every layer when sliding_window is set."""
    w, n = hf.get("sliding_window"), hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is not None:
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad:
            raise UnsupportedModelError(f"layer_types {bad} are not implemented (supported: full_attention, "
                                        "sliding_attention)")
        if len(types) != n:
            raise UnsupportedModelError(f"layer_types has {len(types)} entries for {n} layers")
        out = [int(w) if t == "sliding_attention" else 0 for t in types]
        if any(t == "sliding_attention" for t in types) and not w:
            raise UnsupportedModelError("layer_types has sliding_attention layers but sliding_window is not set")
    else:
        out = [int(w) if w else 0] * n
    return out if any(out) else None


def _llama(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias}


def _mistral(hf: dict) -> dict:
    return {"layer_windows": _windows(hf)}


def _qwen2(hf: dict) -> dict:
    return {"attention_bias": True, "layer_windows": _windows(hf)}


def _qwen2_5_vl(hf: dict) -> dict:
    """Qwen2.5-VL's language model: Qwen2 with M-RoPE (model/qwen2_5_vl.py): the rotary frequencies split
    into mrope_section parts, each rotated by its own row of a 3-row position."""
    sections = hf["rope_parameters"].get("mrope_section")
    half = (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) // 2
    if not isinstance(sections, list) or len(sections) != 3 or sum(sections) != half:
        raise UnsupportedModelError(f"qwen2_5_vl_text: rope_parameters.mrope_section {sections!r} is not three parts "
                                    f"summing to head_dim / 2 = {half}")
    return _qwen2(hf) | {"mrope_section": tuple(sections)}


def _qwen3(hf: dict) -> dict:
    return _llama(hf) | {"qk_norm": True, "layer_windows": _windows(hf)}


def _gemma(hf: dict) -> dict:
    return _llama(hf) | {
        "mlp_act": "gelu_tanh", "sandwich_norm": True, "norm_plus_one": True,
        "embed_scale": math.sqrt(hf["hidden_size"]), "attn_scale": float(hf["query_pre_attn_scalar"]) ** -0.5,
        "attn_softcap": hf.get("attn_logit_softcapping"), "final_softcap": hf.get("final_logit_softcapping"),
        "layer_windows": _windows(hf)}


def _gemma3(hf: dict) -> dict:
    local = hf["rope_parameters"]["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"gemma3_text: sliding layers' rope_type {local.get('rope_type')!r} is not "
                                    "implemented (supported: default)")
    return _gemma(hf) | {"qk_norm": True, "local_rope_theta": float(local["rope_theta"])}


def _granite(hf: dict) -> dict:
    return _llama(hf) | {"embed_scale": float(hf["embedding_multiplier"]), "attn_scale": float(hf["attention_multiplier"]),
                         "residual_scale": float(hf["residual_multiplier"]), "logits_scaling": float(hf["logits_scaling"])}


def _smollm3(hf: dict) -> dict:
    flags = hf["no_rope_layers"]        # 1: the layer uses RoPE, 0: it does not (NoPE)
    if len(flags) != hf["num_hidden_layers"]:
        raise UnsupportedModelError(f"smollm3: no_rope_layers has {len(flags)} entries for "
                                    f"{hf['num_hidden_layers']} layers")
    return _llama(hf) | {"nope_layers": [i for i, f in enumerate(flags) if not f], "layer_windows": _windows(hf)}


def _phi3(hf: dict) -> dict:
    return {"fused_checkpoint": True, "layer_windows": _windows(hf),
            "original_max_position_embeddings": hf.get("original_max_position_embeddings")}


def _mixtral(hf: dict) -> dict:
    return {"num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True, "layer_windows": _windows(hf)}


def _qwen3_moe(hf: dict) -> dict:
    n, step, dense = hf["num_hidden_layers"], hf["decoder_sparse_step"], set(hf["mlp_only_layers"])
    return _qwen3(hf) | {"num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                         "moe_intermediate_size": hf["moe_intermediate_size"], "norm_topk_prob": hf["norm_topk_prob"],
                         "dense_layers": [i for i in range(n) if i in dense or (i + 1) % step != 0]}


_GEMMA_READS = frozenset({"query_pre_attn_scalar", "sliding_window", "layer_types", "final_logit_softcapping",
                          "attn_logit_softcapping", "attention_bias"})
_GEMMA_ONLY = {"hidden_activation": ("gelu_pytorch_tanh",), "use_bidirectional_attention": (None, False)}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), _llama, reads=frozenset({"attention_bias"}),
           inert=frozenset({"pretraining_tp"}), only=SILU | NO_MLP_BIAS),    # (pretraining_tp: unused at inference)
    Family("mistral", ("MistralForCausalLM",), _mistral, reads=frozenset({"sliding_window"}), only=SILU),
    Family("qwen2", ("Qwen2ForCausalLM",), _qwen2, reads=WINDOW_LAYERS, only=SILU),
    Family("qwen2_5_vl_text", ("Qwen2_5_VLForConditionalGeneration",), _qwen2_5_vl, reads=WINDOW_LAYERS, only=SILU,
           rope_reads=frozenset({"mrope_section"})),
    Family("qwen3", ("Qwen3ForCausalLM",), _qwen3, reads=WINDOW_LAYERS | {"attention_bias"}, only=SILU),
    Family("gemma2", ("Gemma2ForCausalLM",), _gemma, reads=_GEMMA_READS, only=_GEMMA_ONLY),
    Family("gemma3_text", ("Gemma3ForCausalLM",), _gemma3, reads=_GEMMA_READS,
           inert=frozenset({"_sliding_window_pattern"}), only=_GEMMA_ONLY),     # (already in layer_types)
    Family("granite", ("GraniteForCausalLM",), _granite,
           reads=frozenset({"attention_bias", "embedding_multiplier", "logits_scaling", "residual_multiplier",
                            "attention_multiplier"}), only=SILU | NO_MLP_BIAS),
    Family("smollm3", ("SmolLM3ForCausalLM",), _smollm3, reads=WINDOW_LAYERS | {"attention_bias", "no_rope_layers"},
           inert=frozenset({"no_rope_layer_interval"}), only=SILU | NO_MLP_BIAS),   # (already in no_rope_layers)
    Family("phi3", ("Phi3ForCausalLM",), _phi3, reads=frozenset({"sliding_window", "original_max_position_embeddings"}),
           inert=frozenset({"resid_pdrop", "embd_pdrop"}), only=SILU),
    Family("mixtral", ("MixtralForCausalLM",), _mixtral, reads=frozenset({"sliding_window", "num_local_experts",
                                                                          "num_experts_per_tok"}),
           inert=ROUTER_TRAINING, only=SILU),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), _qwen3_moe,
           reads=WINDOW_LAYERS | {"attention_bias", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
           inert=ROUTER_TRAINING, only=SILU),
)}
SUPPORTED = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in FAMILIES.values())


def family_of(raw: dict) -> Family:
    """The family of a raw config.json, by model_type and architectures; refused when we have none."""
    mt = raw.get("model_type")
    fam = FAMILIES.get(mt)
    if fam is None:
        raise UnsupportedModelError(f"model_type {mt!r} (architectures {raw.get('architectures')}) is not supported; "
                                    f"supported: {SUPPORTED}")
    archs = raw.get("architectures") or list(fam.architectures)
    if any(a not in fam.architectures for a in archs):
        raise UnsupportedModelError(f"architectures {archs} of model_type {mt!r} are not supported (supported: "
                                    f"{', '.join(fam.architectures)}; of other families: {SUPPORTED})")
    return fam


def check_rope(fam: Family, params: dict) -> None:
    for p in ([params] if "sliding_attention" not in params else params.values()):
        unknown = sorted(set(p) - ROPE_KEYS - fam.rope_reads)
        if unknown:
            raise UnsupportedModelError(f"{fam.name}: rope_parameters fields {unknown} are not implemented")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"{fam.name}: rope_type {kind!r} is not implemented (supported: "
                                        f"{', '.join(ROPE_TYPES)})")
        if p.get("partial_rotary_factor", 1.0) != 1.0 and fam.name != "phi3":
            raise UnsupportedModelError(f"{fam.name}: partial_rotary_factor {p['partial_rotary_factor']} is not "
                                        "implemented for this family")


def from_transformers(name: str):
    """One of transformers' top-level names (resolved through its lazy module). Two threads resolving
    that module at once failed with "cannot import name 'AutoConfig' from 'transformers'" (a torchrun
    start, 1 in a few): an engine's load keeps to one resolving thread (EngineCore._build resolves the
    names on its own thread before the tokenizer's thread starts, where the load itself needs them)."""
    import transformers
    return getattr(transformers, name)


def hf_config_dict(path: str) -> dict:
    """config.json through transformers' own class for its model_type (defaults and conversions)."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if raw.get("model_type") not in VISION_MODEL_TYPES:   # (their text_config: checked as its family's, in the loader)
        family_of(raw)
    AutoConfig = from_transformers("AutoConfig")
    try:
        hf = AutoConfig.for_model(**raw).to_dict()
    except (ValueError, TypeError) as e:      # transformers' own validation (rope lists, sizes, ...)
        raise UnsupportedModelError(f"config.json of {path} is not a valid {raw['model_type']} config: {e}") from e
    # Idefics3's class builds its own tower whatever vision_config.model_type says (and rewrites it): one we
    # do not compute is refused here; SmolVLM's own checkpoints name the tower after the model
    tower = (raw.get("vision_config") or {}).get("model_type")
    if tower not in (None, raw["model_type"], (hf.get("vision_config") or {}).get("model_type")):
        raise UnsupportedModelError(f"{raw['model_type']}: vision_config.model_type {tower!r} is not implemented "
                                    f"(supported: {hf['vision_config'].get('model_type')})")
    return hf


def model_config(hf: dict) -> ModelConfig:
    """Our ModelConfig from a transformers config dict, after every field passed the family's check."""
    fam = family_of(hf)
    fam.check(hf)
    params = hf.get("rope_parameters") or {}
    check_rope(fam, params)
    rope = params.get("full_attention", params)
    heads = hf["num_attention_heads"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    eos = hf.get("eos_token_id")
    return ModelConfig(
        arch=fam.name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf["rms_norm_eps"], rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=None if kind == "default" else dict(rope),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        max_position_embeddings=hf["max_position_embeddings"], tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        **fam.differs(hf))
