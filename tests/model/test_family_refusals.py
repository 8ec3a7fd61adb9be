"""Refuse what we cannot run: every field of each supported family's transformers config class is
either computed (the reference tests switch it on), inert at inference, or refused at load with an
error naming it; an unknown architecture, an unknown field, a RoPE type we lack and a checkpoint
tensor we would skip are refused too. No model may load and compute something else."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedserve.model.families import FAMILIES, INERT, LLAMA_READS, UnsupportedModelError, model_config
from pagedserve.model.loader import ModelLoadError, load_model, read_model_config, resolve_model
from tests.model.families import SMALL, family_specs, save_family

# the language models of vision-language families (no CausalLM class of their own; their reference tests are the
# family's own: tests/model/test_qwen2_5_vl.py): config class, the fields its defaults need (Qwen2.5-VL ties
# its embeddings at the top level: the loader hands that down)
VISION_TEXT = {"qwen2_5_vl_text": ("Qwen2_5_VLTextConfig", {"rope_parameters": {
    "rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}, "tie_word_embeddings": False})}
CONFIG_CLASSES = {name: spec[0] for name, spec in family_specs().items()} | {n: c for n, (c, _) in VISION_TEXT.items()}


def _default_dict(name: str, **fields) -> dict:
    need = VISION_TEXT[name][1] if name in VISION_TEXT else {}
    return getattr(transformers, CONFIG_CLASSES[name])(**(SMALL | {"vocab_size": 256} | need | fields)).to_dict()


def _probe(value):
    """A value different from `value` of the same kind, for the refusal walk."""
    if isinstance(value, bool) or value is None:
        return True if not value else False
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "_other"
    return ["made-up"]


def test_every_family_is_covered():
    assert set(CONFIG_CLASSES) == set(FAMILIES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_config_field_is_implemented_inert_or_refused(name):
    fam = FAMILIES[name]
    hf = _default_dict(name)
    model_config(hf)                                        # the class's defaults are all computed
    for key, value in hf.items():
        if key in INERT or key in LLAMA_READS or key in fam.reads or key in fam.inert:
            continue                                        # computed at every valid value, or no effect
        assert key in fam.only, f"{name}: field {key!r} is neither implemented, inert nor refused"
        other = _probe(value)
        assert other not in fam.only[key]
        with pytest.raises(UnsupportedModelError, match=key):
            model_config(hf | {key: other})
    with pytest.raises(UnsupportedModelError, match="made_up_scaling"):
        model_config(hf | {"made_up_scaling": 2.0})       # a field no class of ours knows
    with pytest.raises(UnsupportedModelError, match="quantization_config"):
        model_config(hf | {"quantization_config": {"quant_method": "awq"}})


@pytest.mark.parametrize("name,fields,needle", [
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "yarn"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
])
def test_unimplemented_values_are_refused(name, fields, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        model_config(_default_dict(name) | fields)


def _write(d, cfg: dict) -> str:
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"")
    return str(d)


@pytest.mark.parametrize("model_type,arch", [("phi", "PhiForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM"),
                                             ("gpt_oss", "GptOssForCausalLM"), ("olmo2", "Olmo2ForCausalLM")])
def test_unknown_architectures_are_refused_naming_them(tmp_path, model_type, arch):
    path = _write(tmp_path, {"model_type": model_type, "architectures": [arch], "hidden_size": 64})
    with pytest.raises(ModelLoadError, match=model_type) as e:
        read_model_config(resolve_model(path))
    assert "supported:" in str(e.value) and "qwen3" in str(e.value)


def test_a_head_we_do_not_run_is_refused(tmp_path):
    """model_type llama but a classification head: not a causal LM this engine computes."""
    path = _write(tmp_path, {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]})
    with pytest.raises(ModelLoadError, match="LlamaForSequenceClassification"):
        read_model_config(resolve_model(path))


def test_a_checkpoint_tensor_we_would_skip_is_refused(tmp_path):
    """A Qwen3 checkpoint relabelled as Qwen2: its q/k norms would be skipped, so it is refused."""
    from safetensors.torch import load_file, save_file
    save_family("qwen3", tmp_path, 256)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    for k in ("attention_bias", "head_dim"):
        cfg.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    w = load_file(tmp_path / "model.safetensors")
    for n in list(w):      # Qwen2 has q/k/v biases: give it some, so only the norms are left over
        if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            w[n.replace("weight", "bias")] = torch.zeros(w[n].shape[0])
    save_file(w, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="q_norm"):
        load_model(resolve_model(str(tmp_path)))
