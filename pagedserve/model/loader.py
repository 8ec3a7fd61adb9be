"""Find and load a model: a GGUF file (any of the common quantizations, dequantized to the compute
dtype) or an HF folder (config.json + *.safetensors). Weights are built on the meta device and
attached with assign=True, so nothing is allocated twice."""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import struct
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve import disk_cache
from pagedserve.engine import startup
from pagedserve.distributed.group import TPGroup
from pagedserve.distributed.sharding import check_tensor_parallel, shard_state_dict
from pagedserve.host import release_free_heap
from pagedserve.model.config import ModelConfig
from pagedserve.model import packed_cache
from pagedserve.model.gguf_packed import FileSpans, make_packed, packed_matrix, pending
from pagedserve.model.families import VISION_MODEL_TYPES, UnsupportedModelError, hf_config_dict, model_config
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.source import (DEFAULT_MODEL_FILE, ModelLoadError, ModelSource, cache_dir,  # noqa: F401
                                     default_model_path, resolve_model)
from pagedserve.model.quant import (AS_Q8_0, FORMATS, QUANTIZATIONS, Packed, PackedEmbedding, PackedLinear,
                                    PackedWeight, dense_copy_plan, describe, interleaves, make_dense_copies,
                                    packed_weights, quantize_int8, stack_rows)

log = logging.getLogger("pagedserve")

SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "granite", "smollm3", "phi3")
# archs whose q/k rows llama.cpp's converter permutes for its interleaved RoPE (LlamaModel and its subclasses)
_PERMUTED_QK = ("llama", "mistral", "granite", "smollm3")


def read_pooling_config(src: ModelSource) -> dict:
    """How the model says embeddings are made (sentence-transformers' files in an HF folder):
    {"pooling_type": LAST | MEAN | CLS | the unsupported mode's name, "normalize": bool,
    "matryoshka": list of allowed dimensions, [] for any, or None (no truncation)}; {} when it says nothing."""
    out: dict = {}
    if src.kind != "hf":
        return out
    cfg_path = os.path.join(src.path, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            hf = json.load(f)
        if hf.get("matryoshka_dimensions") or hf.get("is_matryoshka"):
            out["matryoshka"] = list(hf.get("matryoshka_dimensions") or [])
    modules = os.path.join(src.path, "modules.json")
    if not os.path.isfile(modules):
        return out
    with open(modules) as f:
        mods = json.load(f)
    out["normalize"] = any(str(m.get("type", "")).endswith("Normalize") for m in mods)
    pool = next((m for m in mods if str(m.get("type", "")).endswith("Pooling")), None)
    if pool is not None:
        with open(os.path.join(src.path, pool.get("path", ""), "config.json")) as f:
            pc = json.load(f)
        # sentence-transformers < 6: booleans pooling_mode_<mode>; 6: "pooling_mode": "<mode>" (or a list)
        modes = [k.removeprefix("pooling_mode_") for k, v in pc.items() if k.startswith("pooling_mode_") and v]
        if isinstance(pc.get("pooling_mode"), str):
            modes = [pc["pooling_mode"]]
        elif isinstance(pc.get("pooling_mode"), list):
            modes = list(pc["pooling_mode"])
        if pc.get("include_prompt") is False:
            modes = [f"{m} without the prompt (include_prompt false)" for m in modes]
        names = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS", "max_tokens": "MAX",
                 "mean": "MEAN", "cls": "CLS", "max": "MAX"}
        out["pooling_type"] = names.get(modes[0], modes[0]) if len(modes) == 1 else "+".join(modes) or "none"
    return out


# (file, mtime, dtype, device, ...) -> (the model, or on an accelerator a weak reference to it; its config).
# On the CPU a loaded model stays for the process (engines come and go around it: tests, benches); an
# accelerator's memory is the scarce kind, so there a model lives as long as an engine holds it (an 8B
# model's 15 GiB stayed on an H200 after its engine shut down).
_LOADED: dict[tuple, tuple[LlamaForCausalLM | weakref.ref, ModelConfig]] = {}


def held_for_the_process(device: str) -> bool:
    return torch.device(device).type == "cpu"


def load_model(src: ModelSource, dtype: torch.dtype = torch.float32, device: str = "cpu",
               quantization: str = "none", tp: TPGroup | None = None,
               int8_act: bool = False, dense_copy: bool = False,
               packed_rows: int | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Weights are read-only at inference (the KV cache lives in the runner), so engines in one
    process share one loaded copy per (file, dtype, device, quantization, int8_act, dense_copy, packed_rows).
    quantization: none (dense in `dtype`) | gguf (the file's quantized tensors stay packed) | int8
    (every linear weight quantized per output channel at load).
    int8_act: few-row products with packed weights round their activations to int8 blocks
    (pagedserve.model.quant.int8_activations decides it from the --dtype asked for).
    dense_copy: packed weights also keep a dense copy in `dtype` for many-row products, where it fits
    (--quantization auto: pagedserve.model.quant.choose_quantization).
    packed_rows: pins the decode rows packed products take (default: quant.packed_rows' table).
    tp: this rank's tensor-parallel group; the model is built with this rank's slices only (never
    shared: it holds the group's collectives)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if tp is not None and tp.size > 1:
        if quantization != "none":      # (EngineArgs refuses this first; direct callers get the same answer)
            raise ValueError(f"quantization {quantization!r} is not supported with tensor_parallel_size > 1: "
                             "packed weights are not sharded")
        return _load_model(src, dtype, device, quantization, tp, int8_act)
    if quantization != "none" and device != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU kernels; on {device} use quantization none")
    if quantization == "gguf" and src.kind != "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's quantized tensors, but {src.path} is an HF "
                         "folder; use quantization int8 or none")
    st = os.stat(src.path)
    key = (os.path.realpath(src.path), st.st_mtime_ns, dtype, device, quantization, int8_act, dense_copy, packed_rows,
           src.mmproj and (os.path.realpath(src.mmproj), os.stat(src.mmproj).st_mtime_ns))
    held, cfg = _LOADED.get(key, (None, None))
    model = held() if isinstance(held, weakref.ref) else held
    if model is None:
        model, cfg = _load_model(src, dtype, device, quantization, int8_act=int8_act, dense_copy=dense_copy,
                                 packed_rows=packed_rows)
        _LOADED[key] = (model if held_for_the_process(device) else weakref.ref(model), cfg)
    else:
        with startup.phase("model (shared, loaded before)"):
            pass
    return model, copy.copy(cfg)


def _load_model(src: ModelSource, dtype: torch.dtype, device: str, quantization: str,
                tp: TPGroup | None = None, int8_act: bool = False, dense_copy: bool = False,
                packed_rows: int | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    spans = FileSpans()     # the packed matrices' reads, deferred (gguf_packed.py)
    with startup.phase("model read"):
        if quantization == "gguf":
            cfg, weights = _read_gguf(src.path, dtype, spans)
        else:
            read = torch.float32 if quantization == "int8" else dtype      # int8 scales come from the fp32 weights
            cfg, weights = _read_gguf_cached(src.path, read) if src.kind == "gguf" else _read_hf(src.path, read)
    vision = _vision_weights(cfg, weights) if cfg.vision is not None else None
    if src.mmproj is not None:
        cfg.vision, vision = _read_mmproj(src, cfg, dtype)
    if cfg.vision is not None and tp is not None and tp.size > 1:
        raise ModelLoadError(f"{src.path}: a vision-language model runs on one rank (tensor_parallel_size 1)")
    with startup.phase("model build"):
        model = _build_model(src, cfg, weights, dtype, device, quantization, tp)
        model.vision = None if vision is None else _build_vision(cfg, vision, dtype, device)
    del weights, vision         # the file's tensors (fused ones were copied): not held through the rest of the load
    release_free_heap()
    ws = packed_weights(model)
    copied, line = dense_copy_plan(model, dtype) if dense_copy else ([], None)
    chosen = {id(c) for c in copied}
    copies = [id(w) in chosen for w in ws]
    key = None              # the packed-weight cache's key where this load is cached (packed_cache.py)
    if ws and src.kind == "gguf" and device == "cpu" and (tp is None or tp.size == 1):
        with startup.phase("packed cache read"):
            key = packed_cache.entry_key(src.path, ws, dtype, int8_act, copies)
            if packed_cache.restore(key, ws, dtype, copies):
                what = [w for w, on in (("interleaved", int8_act), ("dense copies", copied)) if on] or ["as built"]
                log.info("packed weights: %s, read from the cache (%s)", " + ".join(what), packed_cache.entry_path(key))
                key, copied = None, []       # there already: nothing to compute or write
    if pending(ws):
        with startup.phase("packed weights read"):      # a miss: the file's packed tensors, one weight at a time
            products = [m.weight for layer in model.layers for m in layer.products()] + [model.head_weight]
            make_packed(ws, spans, {id(w) for w in products} if interleaves(int8_act) else set())
    if copied:
        with startup.phase("dense copies"):
            make_dense_copies(copied, dtype)
    if line:
        log.info("%s", line)
    with startup.phase("kernel loads"):
        log.info("%s", model.choose_gemm_form(int8_act, packed_rows))
        log.info("%s", model.choose_layer_path())
        log.info("%s", model.choose_decode_path())
    # after the kernels' layout (interleaved x8 groups) is chosen: the same words whether the packed cache hit
    model.weights_desc = f"{str(dtype).removeprefix('torch.')} {describe(model)}"
    if key is not None:
        with startup.phase("packed cache write"):
            packed_cache.save(key, ws)
    release_free_heap()         # the read's transients and the weights a cache entry replaced, freed but resident
    return model, cfg


def _build_model(src: ModelSource, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device: str,
                 quantization: str, tp: TPGroup | None) -> LlamaForCausalLM:
    """The module tree on the meta device, the read tensors assigned into it (packed ones as packed modules)."""
    sd = _fuse(cfg, weights)
    if quantization == "int8":
        sd = {k: quantize_int8(v) if _is_matrix(k) else v.to(dtype) for k, v in sd.items()}
    sd = {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    if tp is not None and tp.size > 1:
        check_tensor_parallel(cfg, tp.size)
        sd = shard_state_dict(cfg, sd, tp.rank, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    _check_shapes(src, cfg, sd, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    for key, w in sd.items():
        if isinstance(w, Packed):           # the module holding it becomes a packed one
            parent, _, child = key.removesuffix(".weight").rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            packed = (PackedEmbedding(w, dtype) if child == "embed_tokens"
                      else PackedLinear(w, bias=f"{key.removesuffix('.weight')}.bias" in sd))
            setattr(owner, child, packed)
    model.load_state_dict({k: v for k, v in sd.items() if not isinstance(v, Packed)}, assign=True, strict=True)
    return model.to(device).eval()


def _vision_weights(cfg: ModelConfig, weights: dict) -> dict:
    return cfg.vision.take_weights(weights)    # (the encoder's tensors, popped from weights)


def _read_mmproj(src: ModelSource, cfg: ModelConfig, dtype: torch.dtype):
    """llama.cpp's image encoder beside a GGUF text model: its config and tensors (model/mmproj.py)."""
    from pagedserve.model.mmproj import read_mmproj
    if src.kind != "gguf":
        raise ModelLoadError(f"--mmproj {src.mmproj}: an image encoder file goes beside a GGUF text model, and "
                             f"{src.path} is an HF folder (its config.json names its own vision tower)")
    try:
        return read_mmproj(src.mmproj, cfg.hidden_size, dtype)
    except UnsupportedModelError as e:
        raise ModelLoadError(str(e)) from None


def _build_vision(cfg: ModelConfig, sd: dict, dtype: torch.dtype, device: str):
    """The image encoder (model/vision.py, idefics3.py, gemma3_vision.py), beside the language model: dense in
    the model's dtype."""
    with torch.device("meta"):
        vision = cfg.vision.build()
    want = {k: tuple(v.shape) for k, v in vision.state_dict().items()}
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or extra:
        raise ModelLoadError(f"the vision tower's checkpoint tensors do not match its config (missing {missing[:3]}, "
                             f"unused {extra[:3]})")
    bad = [k for k, v in sd.items() if tuple(v.shape) != want[k]]
    if bad:
        raise ModelLoadError(f"vision tensor {bad[0]} has shape {tuple(sd[bad[0]].shape)}, expected {want[bad[0]]}")
    vision.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True, strict=True)
    return vision.to(device).eval()


def _check_shapes(src: ModelSource, cfg: ModelConfig, sd: dict, expected: dict[str, tuple]) -> None:
    """Every tensor the shape the file's metadata implies (a torch error at assignment would name neither)."""
    for key, w in sd.items():
        want = expected.get(key)
        if want is not None and tuple(w.shape) != want:
            raise ModelLoadError(
                f"{src.path}: tensor {key} has shape {tuple(w.shape)}, but the metadata ({cfg.num_layers} layers, "
                f"hidden {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
                f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}) gives {want}")


_MATRICES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "embed_tokens.weight",
             "lm_head.weight")

_HF_MATRICES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                "up_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight",
                "qkv_proj.weight", "gate_up_proj.weight")     # (Phi-3's fused checkpoints)


def _is_matrix(key: str) -> bool:
    return key.endswith(_MATRICES)


def _cat(parts: list, name: str = "") -> torch.Tensor | Packed:
    """Fuse projections: dense tensors concatenate; packed weights stack their rows (each run of one
    format packed as it is: stack_rows); a part without a packed kernel (dense) makes the whole dense."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, PackedWeight) for p in parts):
        return stack_rows(parts)
    log.info("%s: a part has no packed kernel (%s): the fused product is kept dense", name,
             ", ".join(p.fmt if isinstance(p, PackedWeight) else "dense" for p in parts))
    return torch.cat([p.dequantize() if isinstance(p, PackedWeight) else p.float() for p in parts])


def _fuse(cfg: ModelConfig, weights: dict) -> dict:
    """HF-named tensors (dense, or PackedWeight for --quantization gguf) -> our fused module's state dict.
    Every checkpoint tensor must be used: one left over is maths we would silently skip (a norm, a
    bias of a family we do not know), so the load is refused naming it."""
    w = dict(weights)
    take = w.pop
    sd = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p, a, o = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"layers.{i}."
        sd[o + "attn_norm"] = take(p + "input_layernorm.weight")
        if cfg.sandwich_norm:       # Gemma: post_attention_layernorm norms the attention output
            sd[o + "post_attn_norm"] = take(p + "post_attention_layernorm.weight")
            sd[o + "mlp_norm"] = take(p + "pre_feedforward_layernorm.weight")
            sd[o + "post_mlp_norm"] = take(p + "post_feedforward_layernorm.weight")
        else:                       # Llama: post_attention_layernorm is the MLP's input norm
            sd[o + "mlp_norm"] = take(p + "post_attention_layernorm.weight")
        if cfg.fused_checkpoint:
            sd[o + "qkv_proj.weight"] = take(a + "qkv_proj.weight")
        else:
            sd[o + "qkv_proj.weight"] = _cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                                             take(a + "v_proj.weight")], o + "qkv_proj")
        if cfg.attention_bias:
            sd[o + "qkv_proj.bias"] = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                                take(a + "v_proj.bias")])
        sd[o + "o_proj.weight"] = take(a + "o_proj.weight")
        if cfg.o_proj_bias:
            sd[o + "o_proj.bias"] = take(a + "o_proj.bias")
        if cfg.qk_norm:
            sd[o + "q_norm"], sd[o + "k_norm"] = take(a + "q_norm.weight"), take(a + "k_norm.weight")
        if cfg.is_moe and i not in cfg.dense_layers:
            sd.update(_experts(cfg, w, i))
        elif cfg.fused_checkpoint:
            sd[o + "gate_up_proj.weight"] = take(p + "mlp.gate_up_proj.weight")
            sd[o + "down_proj.weight"] = take(p + "mlp.down_proj.weight")
        else:
            sd[o + "gate_up_proj.weight"] = _cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")],
                                                 o + "gate_up_proj")
            sd[o + "down_proj.weight"] = take(p + "mlp.down_proj.weight")
    w.pop("lm_head.weight", None)   # tied models may store a copy of the embedding
    if w:
        raise ModelLoadError(f"{cfg.arch}: checkpoint tensors {sorted(w)[:5]}{' ...' if len(w) > 5 else ''} "
                                    "are not used by this engine's implementation of the family; refusing to load "
                                    "a model whose computation would skip them")
    if cfg.norm_plus_one:           # Gemma's RMSNorm scales by (1 + w): fold the 1 in once, here
        sd = {k: v + 1.0 if k == "norm" or k.endswith("_norm") else v for k, v in sd.items()}
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _experts(cfg: ModelConfig, w: dict, i: int) -> dict:
    """One MoE layer's router and experts, stacked (experts, rows, cols): Mixtral names them
    block_sparse_moe.{gate, experts.E.w1 (gate), w3 (up), w2 (down)}, Qwen3-MoE mlp.{gate, experts.E.*_proj}."""
    p, o = f"model.layers.{i}.", f"layers.{i}.moe."
    mixtral = p + "block_sparse_moe.gate.weight" in w
    base = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    gate_up, down = [], []
    for e in range(cfg.num_experts):
        g, u, d = (w.pop(f"{base}experts.{e}.{n}.weight") for n in names)
        gate_up.append(torch.cat([_dense(g), _dense(u)]))
        down.append(_dense(d))
    return {o + "router": _dense(w.pop(base + "gate.weight")), o + "gate_up": torch.stack(gate_up),
            o + "down": torch.stack(down)}


def _dense(t) -> torch.Tensor:
    return t.dequantize() if isinstance(t, Packed) else t


# ---------------------------------------------------------------- HF folders (safetensors)

def _read_hf(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    cfg = _hf_model_config(path)
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            try:
                weights.update({k: v.to(dtype) for k, v in load_file(os.path.join(path, f)).items()})
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read safetensors file {f} in {path}: {e}") from e
    if cfg.vision is not None:          # LLaVA: its language model's tensors under the names a Llama's have
        weights = {_language_model_name(k): v for k, v in weights.items()}
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        cfg.tie_word_embeddings = True
    return cfg, weights


def _language_model_name(key: str) -> str:
    """A LLaVA checkpoint's name of a language-model tensor -> a Llama's (both layouts transformers wrote:
    `language_model.model.X` / `language_model.lm_head`, and `model.language_model.X` / `lm_head`)."""
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model."), ("model.text_model.", "model.")):   # (the last: Idefics3's)
        if key.startswith(old):
            return new + key[len(old):]
    return key


# ---------------------------------------------------------------- GGUF

# a uint64 of the file: in this host's byte order ("I"), or swapped ("S"), as gguf's reader says
_U64 = {"I": struct.Struct("=Q").unpack_from, "S": struct.Struct(">Q" if sys.byteorder == "little" else "<Q").unpack_from}


def gguf_reader(path: str):
    """gguf's reader, but an array field is read as one span (its element type, its length, its bytes),
    not element by element: the tokenizer's 150k-entry arrays took ~8 s of every start of a Qwen2.5 file
    this way (it is what the engine itself reads: scalars, strings and tensors; the tokenizer is
    transformers' own read, converted once and cached). Array fields then give their length through
    gguf_array_len, and no contents()."""
    import gguf

    class _SpanReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs, n, t = orig_offs + 12, int(alen[0]), gguf.GGUFValueType(itype[0])
            if t == gguf.GGUFValueType.STRING:          # walk the lengths only (struct on the mapped bytes:
                buf, length = memoryview(self.data), _U64[self.byte_order]    # ~30x numpy's slice per string)
                for _ in range(n):
                    offs += 8 + length(buf, offs)[0]
            elif t == gguf.GGUFValueType.ARRAY:
                raise ValueError("nested GGUF arrays are not read")
            else:
                offs += n * np.dtype(self.gguf_scalar_to_np[t]).itemsize
            return offs - orig_offs, [itype, alen, self.data[orig_offs + 12:offs]], [], [gguf.GGUFValueType.ARRAY, t]

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            # a truncated file: named by its first tensor whose bytes it lacks (gguf's reshape error names none)
            for f in fields:
                name, dims, raw, at = bytes(f.parts[1]).decode(errors="replace"), f.parts[3], *f.parts[4:6]
                if raw[0] in gguf.GGMLQuantizationType._value2member_map_:
                    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw[0])]
                    end = int(start_offs + at[0]) + int(np.prod(dims)) * size // block
                    if end > len(self.data):
                        raise ValueError(f"tensor {name} needs bytes up to {end}, but the file ends at "
                                         f"{len(self.data)} (truncated?)")
            super()._build_tensors(start_offs, fields)

    return _SpanReader(path, "c")     # copy-on-write: tensors are writable views of the mapped file, not copies


def gguf_array_len(reader, key: str) -> int | None:
    f = reader.fields.get(key)
    return None if f is None else int(f.parts[-2][0])


def gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _read_gguf_cached(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Parsing a GGUF in Python and dequantizing it take most of a load (~5 s + ~2 s for the default
    model); the fp32 result is kept as safetensors and reused while the file is unchanged."""
    from safetensors.torch import load_file, save_file
    d = cache_dir(path, "weights")
    wf, cf = os.path.join(d, "model.safetensors"), os.path.join(d, "config.json")
    if os.path.isfile(wf) and os.path.isfile(cf):
        try:
            with open(cf) as f:
                cfg = ModelConfig(**json.load(f))
            weights = {k: v.to(dtype) for k, v in load_file(wf).items()}
            disk_cache.used(d)
            return cfg, weights
        except Exception:   # a damaged cache is rebuilt, never fatal
            pass
    cfg, weights = _read_gguf(path, torch.float32)
    try:
        os.makedirs(d, exist_ok=True)
        save_file(weights, wf + ".tmp")
        os.replace(wf + ".tmp", wf)
        with open(cf + ".tmp", "w") as f:
            json.dump(dataclasses.asdict(cfg), f)
        os.replace(cf + ".tmp", cf)
        disk_cache.prune(os.path.dirname(d), keep=d)      # the folder kept to its budget (disk_cache)
    except OSError:
        pass   # a read-only or full disk only costs the parse next time
    return cfg, {k: v.to(dtype) for k, v in weights.items()}


def _read_gguf(path: str, dtype: torch.dtype, spans: FileSpans | None = None) -> tuple[ModelConfig, dict]:
    """With `spans` (packed): the matrices whose type the qmatmul kernels read (FORMATS) stay in their blocks,
    as PackedWeight, read only when made (gguf_packed.py; their reads noted in `spans`); everything else is
    dequantized to `dtype`."""
    packed = spans is not None
    try:
        reader = gguf_reader(path)
    except Exception as e:  # bad magic, truncated file, ...
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"GGUF architecture {arch!r} in {path} is not supported (supported: {GGUF_ARCHS})")
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_GGUF_TYPES:
            raise ModelLoadError(f"unsupported GGUF quantization type {t.tensor_type.name} for tensor {t.name} in "
                                 f"{path} (supported: {', '.join(SUPPORTED_GGUF_TYPES)})")
    try:
        cfg = _gguf_config(reader, arch)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"GGUF file {path} lacks the metadata of a {arch} model: {e!r}") from e
    keep = {t.name for t in reader.tensors if packed and _packable(t, arch)}
    dense = [t for t in reader.tensors if t.name not in keep]
    if packed:
        _log_dense_matrices([t for t in dense if _is_projection(t, arch)])
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        arrays = dict(zip([t.name for t in dense], pool.map(_dequantize, dense)))
    if packed:
        spans.attach(reader)
        arrays.update({t.name: packed_matrix(t, spans) for t in reader.tensors if t.name in keep})
    weights = {}
    for name, arr in arrays.items():
        hf_name = _gguf_to_hf_name(name, arch)
        if hf_name is None:
            continue
        if isinstance(arr, PackedWeight):
            if arch in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
                arr = arr.permute_rows(_unpermute(torch.arange(arr.shape[0]), heads))
            weights[hf_name] = arr
            continue
        t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if ".experts." in hf_name:           # (experts, rows, cols): one checkpoint tensor per expert
            for e in range(t.shape[0]):
                weights[hf_name.replace(".experts.", f".experts.{e}.")] = t[e].to(dtype)
            continue
        if arch in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's converter permutes q/k rows for its interleaved RoPE; undo it for the half-split RoPE.
            heads = cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads
            t = _unpermute(t, heads)
        weights[hf_name] = t.to(dtype)
    if "lm_head.weight" not in weights:
        cfg.tie_word_embeddings = True
    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in weights]
    if missing:
        raise ModelLoadError(f"GGUF file {path} lacks tensors {missing}")
    return cfg, weights


def _is_projection(t, arch: str) -> bool:
    return len(t.shape) == 2 and (_gguf_to_hf_name(t.name, arch) or "").endswith(_HF_MATRICES)


def _packable(t, arch: str) -> bool:
    """A matrix the qmatmul kernels read: its type is a kernel's (FORMATS; GGUF's own I8 is unscaled, not
    our I8 rows) or is rewritten to one without loss (AS_Q8_0)."""
    name = t.tensor_type.name
    return (name in FORMATS and name != "I8" or name in AS_Q8_0) and _is_projection(t, arch)


def _log_dense_matrices(ts: list) -> None:
    """One line for the matrices kept dense under --quantization auto|gguf: types without a packed kernel
    (F16, BF16, F32, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_XS), each with its tensors."""
    by_type: dict[str, list[str]] = {}
    for t in ts:
        by_type.setdefault(t.tensor_type.name, []).append(t.name)
    if by_type:
        log.info("dense (no packed kernel for the type): %s", "; ".join(
            f"{k} x {len(v)} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''})" for k, v in sorted(by_type.items())))


def _gguf_config(reader, arch: str) -> ModelConfig:
    def g(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    n_vocab = g("vocab_size")
    if n_vocab is None:
        n_vocab = gguf_array_len(reader, "tokenizer.ggml.tokens")
    scaling = None
    if g("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    layers, head_dim = int(g("block_count")), int(g("attention.key_length", hidden // heads))
    differs: dict = {"arch": arch}
    if arch == "llama" and g("expert_count"):     # Mixtral: llama.cpp writes it as a llama with experts
        differs |= {"num_experts": int(g("expert_count")), "num_experts_per_tok": int(g("expert_used_count")),
                    "moe_intermediate_size": int(g("expert_feed_forward_length") or g("feed_forward_length")),
                    "norm_topk_prob": True}
    if arch == "phi3":
        # fused qkv and gate_up; partial RoPE; longrope's two factor lists as tensors of their own
        orig, rot = g("rope.scaling.original_context_length"), int(g("rope.dimension_count", head_dim))
        factors = {t.name: [float(x) for x in np.asarray(t.data, dtype=np.float32)] for t in reader.tensors
                   if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")}
        window = int(g("attention.sliding_window", 0) or 0)
        differs |= {"fused_checkpoint": True, "partial_rotary_factor": rot / head_dim,
                    "original_max_position_embeddings": None if orig is None else int(orig),
                    "layer_windows": [window] * layers if window else None}
        if factors:
            scaling = {"rope_type": "longrope", "short_factor": factors["rope_factors_short.weight"],
                       "long_factor": factors["rope_factors_long.weight"], "original_max_position_embeddings": int(orig),
                       "attention_factor": float(g("rope.scaling.attn_factor", 1.0))}
    if arch in ("qwen3", "qwen3moe"):
        differs["qk_norm"] = True
    if arch == "qwen3moe":          # every layer an MoE layer; llama.cpp renormalises the top-k weights
        differs |= {"num_experts": int(g("expert_count")), "num_experts_per_tok": int(g("expert_used_count")),
                    "moe_intermediate_size": int(g("expert_feed_forward_length")), "norm_topk_prob": True}
    elif arch in ("gemma2", "gemma3"):
        # as llama.cpp reads a Gemma file: its converter already added Gemma's 1 to the norm weights;
        # every 2nd (Gemma 2) / 6th (Gemma 3) layer is global, the others slide (Gemma 3's with RoPE
        # base 10000); the attention scale is 1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the
        # 27B models (46 / 62 layers); Gemma 2 soft-caps the attention scores and the logits
        gemma2 = arch == "gemma2"
        window, every = int(g("attention.sliding_window", 0)), 2 if gemma2 else 6
        differs |= {"qk_norm": not gemma2, "sandwich_norm": True, "mlp_act": "gelu_tanh",
                    "embed_scale": math.sqrt(hidden), "local_rope_theta": None if gemma2 else 10000.0,
                    "attn_scale": (hidden / heads if layers == (46 if gemma2 else 62) else head_dim) ** -0.5,
                    "layer_windows": [0 if (i + 1) % every == 0 else window for i in range(layers)] if window else None}
        if gemma2:
            differs |= {k: None if v is None else float(v) for k, v in (
                ("attn_softcap", g("attn_logit_softcapping")), ("final_softcap", g("final_logit_softcapping")))}
    elif arch == "smollm3":         # llama.cpp: no key for it, every 4th layer without RoPE
        differs["nope_layers"] = [i for i in range(layers) if (i + 1) % 4 == 0]
    elif arch == "granite":
        # llama.cpp's names for Granite's multipliers (its converter writes *_multiplier as *_scale)
        differs |= {"embed_scale": float(g("embedding_scale", 1.0)), "residual_scale": float(g("residual_scale", 1.0)),
                    "logits_scaling": float(g("logit_scale", 1.0)), "attn_scale": float(g("attention.scale"))}
    return ModelConfig(
        vocab_size=int(n_vocab), hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        attention_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)], **differs,
    )


def _dequantize(t) -> np.ndarray:
    import gguf
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.ascontiguousarray(arr, dtype=np.float32)


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    # MoE: the router, and each projection of all experts stacked in one tensor
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight", "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
# Gemma's four norms per layer (llama.cpp's names; its ffn_norm is Gemma's pre-feedforward norm)
_GGUF_GEMMA_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                     "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


# Phi-3's fused checkpoints (llama.cpp's ffn_up holds gate and up, as Phi-3's gate_up_proj)
_GGUF_PHI3_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}


def _gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    if name.startswith("blk."):
        _, i, rest = name.split(".", 2)
        if arch in ("gemma2", "gemma3") and rest in _GGUF_GEMMA_NAMES:
            return f"model.layers.{i}.{_GGUF_GEMMA_NAMES[rest]}"
        if arch == "phi3" and rest in _GGUF_PHI3_NAMES:
            return f"model.layers.{i}.{_GGUF_PHI3_NAMES[rest]}"
        if rest in _GGUF_LAYER_NAMES:
            return f"model.layers.{i}.{_GGUF_LAYER_NAMES[rest]}"
    return None   # e.g. rope_freqs: not a weight we need


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_model_config(path: str) -> ModelConfig:
    """config.json -> ModelConfig, refusing any architecture or field we do not compute (families.py)."""
    try:
        hf = hf_config_dict(path)
        if hf.get("model_type") not in VISION_MODEL_TYPES:
            return model_config(hf)
        from pagedserve.model.gemma3_vision import gemma3_vision_config   # a vision-language model: its parts
        from pagedserve.model.idefics3 import idefics3_vision_config
        from pagedserve.model.llava_next import llava_next_vision_config
        from pagedserve.model.vision import llava_vision_config
        from pagedserve.model.qwen2_5_vl import qwen2_5_vl_vision_config
        vision = {"llava": llava_vision_config, "llava_next": llava_next_vision_config,
                  "gemma3": gemma3_vision_config, "qwen2_5_vl": lambda hf: qwen2_5_vl_vision_config(hf, path)}.get(
            hf["model_type"], idefics3_vision_config)(hf)
        text = hf["text_config"]           # (Qwen2.5-VL's ties its embeddings at the top level only)
        cfg = model_config(text if "tie_word_embeddings" in text else
                           {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", False)})
        cfg.vision = vision
        return cfg
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"cannot read {path}/config.json as a model config: {e!r}") from e


def read_model_config(src: ModelSource) -> ModelConfig:
    """The model's shape without loading its weights."""
    if src.kind == "hf":
        return _hf_model_config(src.path)
    try:
        reader = gguf_reader(src.path)
    except Exception as e:
        raise ModelLoadError(f"{src.path} is not a readable GGUF file: {e}") from e
    return _gguf_config(reader, gguf_field(reader, "general.architecture"))
