"""LoRA adapters over the base model's fused products, many adapters in one step.

An adapter (a PEFT folder: adapter_config.json + adapter_model.safetensors) adds scale * B(A(x)) to
the output of some of each layer's products. Our layer fuses q/k/v into one product and gate/up into
another (model/llama.py); an adapter's q, k and v pairs are each a part of it.

`LoRASlots` (the runner owns it) holds `max_loras` slots per product. A step's rows carry a slot each
(-1: the base model); for every adapted product the step computes, once for all its rows,

    xa = (x @ A.T) * mask;   y[:, part] += xa[:, part] @ B[part]   (each part: q, k, v / gate, up)

mask (rows, slots x max_rank) being 1 where a column belongs to the row's own slot: a few small GEMMs
per product for all decode rows whatever the number of adapters in the step (vLLM's punica kernels do
the same job with a gather); other slots and padding ranks add exact zeros. Prefill rows, many per
sequence, run in runs of one adapter, each multiplied by its own slot only. Base-only steps skip it all."""
from __future__ import annotations

import json
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.errors import ParamError
from pagedserve.model.config import ModelConfig

# PEFT's module name -> (our product, part index within it; None: the checkpoint's module is fused as ours)
_MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
            "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
            "gate_up_proj": ("gate_up", None), "down_proj": ("down", 0)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_CONFIG = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained modules)",
                   "lora_bias": "lora_bias"}


@dataclass(slots=True)
class LoRAPart:
    layer: int
    product: str                 # qkv | o | gate_up | down
    part: int | None             # q/k/v or gate/up index; None: the whole fused product
    a: torch.Tensor              # (r, in)
    b: torch.Tensor              # (out of the part, r), scale folded in


@dataclass(slots=True)
class LoRAWeights:
    """One adapter as read from its folder: its parts, its rank (the largest), its path."""

    path: str
    rank: int
    parts: list[LoRAPart]

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.parts)


def product_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Our products' (input size, output sizes of their parts) for one layer."""
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [inter, inter]), "down": (inter, [h])}


def read_adapter(path: str, cfg: ModelConfig, max_rank: int, field: str = "lora_path") -> LoRAWeights:
    """A PEFT LoRA folder for this model, checked against it; a ParamError (a ValueError) naming the
    path's parameter `field` and what does not fit."""
    from safetensors.torch import load
    conf_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(conf_path):
        raise ParamError(field, f"{field}: {path!r} is not a PEFT adapter folder (no adapter_config.json)")
    try:
        with open(conf_path) as f:
            conf = json.load(f)
        if not isinstance(conf, dict):
            raise ValueError("not a JSON object")
        alpha, rslora = float(conf.get("lora_alpha", 8)), bool(conf.get("use_rslora", False))
    except (OSError, ValueError, TypeError) as e:
        raise ParamError(field, f"{field}: {path!r}: adapter_config.json cannot be read ({e})") from None
    if conf.get("peft_type", "LORA") != "LORA":
        raise ParamError(field, f"{field}: {path!r} is a {conf.get('peft_type')} adapter; only LORA is supported")
    for key, what in _REFUSED_CONFIG.items():
        if conf.get(key):
            raise ParamError(field, f"{field}: {path!r} uses {what}, which is not supported")
    if conf.get("bias", "none") != "none":
        raise ParamError(field, f"{field}: {path!r} trains biases (bias={conf['bias']!r}), which is not supported")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise ParamError(field, f"{field}: {path!r} has no adapter_model.safetensors")
    # read whole, then parsed: safetensors 0.8's safe_open (load_file) keeps ~55 bytes of Python objects per
    # tensor per file opened, 23 KB for each adapter loaded at run time (bench/lora.py --churn)
    try:
        with open(weights_path, "rb") as f:
            tensors = load(f.read())
    except Exception as e:                                  # safetensors' own error type for a bad file
        raise ParamError(field, f"{field}: {path!r}: adapter_model.safetensors cannot be read ({e})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}                  # the module's name in the model (for alpha_pattern)
    for key, t in sorted(tensors.items()):          # (a stable order: the first bad key is named)
        m = _KEY.search(key)
        if m is not None and m.group(2) == "experts":
            raise ParamError(field, f"{field}: {path!r} adapts {key!r}: adapters of mixture-of-experts layers are not "
                             "supported (adapt the attention projections only)")
        if m is None or m.group(2) not in _MODULES:
            raise ParamError(field, f"{field}: {path!r} adapts {key!r}; supported: the attention and MLP projections "
                             f"({', '.join(_MODULES)}) of each layer")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
        names[int(m.group(1)), m.group(2)] = key[:key.rindex(".lora_")].removeprefix("base_model.model.")
    shapes = product_shapes(cfg)
    parts, rank = [], 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"{field}: {path!r}, layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise ParamError(field, f"{where}: lora_A and lora_B must both be present")
        if layer >= cfg.num_layers:
            raise ParamError(field, f"{where}: the model has {cfg.num_layers} layers")
        if cfg.is_moe and module in ("gate_proj", "up_proj", "gate_up_proj", "down_proj") \
                and layer not in cfg.dense_layers:
            raise ParamError(field, f"{where}: the model's MLP in this layer is a mixture of experts; adapters of "
                             "experts are not supported")
        product, part = _MODULES[module]
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        inp, outs = shapes[product]
        out = sum(outs) if part is None else outs[part]
        if a.shape != (r, inp) or b.shape != (out, r):
            raise ParamError(field, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                             f"model's ({out}, {inp}) projection")
        if r > max_rank:
            raise ParamError(field, f"{where}: rank {r} exceeds max_lora_rank ({max_rank})")
        a_mod = _pattern(conf.get("alpha_pattern"), names[layer, module], alpha)
        scale = a_mod / (math.sqrt(r) if rslora else r)
        parts.append(LoRAPart(layer, product, part, a.contiguous(), (b * scale).contiguous()))
        rank = max(rank, r)
    if not parts:
        raise ParamError(field, f"{field}: {path!r} holds no LoRA weights")
    return LoRAWeights(path, rank, parts)


def _pattern(patterns: dict | None, name: str, default: float) -> float:
    """PEFT's alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return float(value)
    return default


class LoRASlots:
    """The runner's adapters: all those registered (in memory), and `max_loras` slots per product that
    a step's rows read from. A step may use at most max_loras adapters (the scheduler sees to it).

    Per layer and product: A (parts x slots x max_rank, in), part-major (part p's rows for every slot,
    then part p + 1's), and one B per part (slots x max_rank, the part's outputs): q, k and v (gate and
    up) each multiply only their own columns, never a block-diagonal B of zeros."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device):
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.adapters: dict[int, LoRAWeights] = {}                 # lora id -> weights
        self.slot_of: OrderedDict[int, int] = OrderedDict()        # lora id -> slot, least recently used first
        # (layer, product) -> (A, [B of each part]); made when an adapter first needs them
        self.tensors: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._shapes, self._device = product_shapes(cfg), device

    def add(self, lora_id: int, weights: LoRAWeights) -> None:
        self.adapters[lora_id] = weights

    @torch.inference_mode()      # the slot tensors are made and written in inference mode (the runner's step)
    def remove(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self._clear(slot)

    def _rows(self, part: int, slot: int) -> slice:
        first = (part * self.max_loras + slot) * self.max_rank
        return slice(first, first + self.max_rank)

    def _clear(self, slot: int) -> None:
        for a, bs in self.tensors.values():
            for part, b in enumerate(bs):
                a[self._rows(part, slot)] = 0
                b[self._rows(0, slot)] = 0

    @torch.inference_mode()
    def _load(self, lora_id: int, slot: int) -> None:
        self._clear(slot)
        for p in self.adapters[lora_id].parts:
            key = (p.layer, p.product)
            inp, outs = self._shapes[p.product]
            if key not in self.tensors:
                n = self.max_loras * self.max_rank
                self.tensors[key] = (torch.zeros(len(outs) * n, inp, dtype=self.dtype, device=self._device),
                                     [torch.zeros(n, o, dtype=self.dtype, device=self._device) for o in outs])
            a, bs = self.tensors[key]
            r = p.a.shape[0]
            # a fused checkpoint module (part None) feeds every part: its A is repeated, its B split by columns
            parts = range(len(outs)) if p.part is None else (p.part,)
            col = 0
            for part in parts:
                rows = self._rows(part, slot)
                b = p.b if p.part is not None else p.b[col:col + outs[part]]
                col += outs[part]
                a[rows.start:rows.start + r] = p.a.to(self.dtype)
                bs[part][rows.start - part * self.max_loras * self.max_rank:][:r] = b.t().to(self.dtype)

    def batch(self, row_ids: list[int], num_decode_rows: int) -> LoRABatch | None:
        """What a step's rows (their lora id each, 0 for the base model; decode rows first, then prefill
        rows, those of one adapter adjacent) read; None when none is adapted. Adapters not in a slot take
        the least recently used slot that no row of this step needs."""
        used = set(row_ids) - {0}
        if not used:
            return None
        if len(used) > self.max_loras:
            raise RuntimeError(f"a step uses {len(used)} adapters, more than max_loras ({self.max_loras})")
        for lora_id in used:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            taken = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slot_of if i not in used)
                slot = self.slot_of.pop(victim)
            self._load(lora_id, slot)
            self.slot_of[lora_id] = slot
        d = num_decode_rows
        decode = [self.slot_of[i] if i else -1 for i in row_ids[:d]]
        segments, start = [], d                     # prefill rows: (first, end, slot) per run of one adapter
        for r in range(d + 1, len(row_ids) + 1):
            if r == len(row_ids) or row_ids[r] != row_ids[start]:
                if row_ids[start]:
                    segments.append((start, r, self.slot_of[row_ids[start]]))
                start = r
        return LoRABatch(self, decode if any(s >= 0 for s in decode) else [], segments)


class LoRABatch:
    """One step's view of the slots: `add` puts each row's adapter delta on a product's output. Decode
    rows (a few per adapter) are masked: one A product over every slot for all of them, each row keeping
    its own slot's columns; prefill rows come in runs of one adapter, each multiplied by its own slot
    only (a prompt chunk's many rows would otherwise pay every slot's arithmetic)."""

    def __init__(self, slots: LoRASlots, decode_slots: list[int], segments: list[tuple[int, int, int]]):
        self.slots, self.segments, self.num_decode = slots, segments, len(decode_slots)
        self.decode_slots = decode_slots            # each decode row's slot, -1 for the base model
        self._masks: dict[int, torch.Tensor] = {}
        # decode rows read slots 0..m-1 only (slots are taken lowest first: a step of one adapter reads one)
        self.num_slots = max(decode_slots, default=-1) + 1
        if decode_slots:
            row_slot = torch.tensor(decode_slots, device=slots._device)
            cols = torch.arange(self.num_slots * slots.max_rank, device=row_slot.device) // slots.max_rank
            self._masks[1] = (cols[None, :] == row_slot[:, None]).to(slots.dtype)   # (rows, m x max_rank)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, product: str) -> torch.Tensor:
        """y (rows, out) += each row's adapter delta of x (rows, in) for this layer's product; in place."""
        ab = self.slots.tensors.get((layer, product))
        if ab is None:
            return y
        a, bs = ab
        parts, R, n = len(bs), self.slots.max_rank, self.slots.max_loras * self.slots.max_rank
        if self.num_decode and self.num_slots == self.slots.max_loras:    # one product for every part's A
            d = self.num_decode
            mask = self._masks.get(parts)
            if mask is None:
                mask = self._masks[parts] = self._masks[1].repeat(1, parts)
            xa = F.linear(x[:d], a).mul_(mask)                  # (rows, parts x slots x max_rank)
            col = 0
            for p, b in enumerate(bs):
                y[:d, col:col + b.shape[1]].addmm_(xa[:, p * n:(p + 1) * n], b)
                col += b.shape[1]
        elif self.num_decode:                                    # the first m slots of each part
            d, m, col = self.num_decode, self.num_slots * R, 0
            for p, b in enumerate(bs):
                xa = F.linear(x[:d], a[p * n:p * n + m]).mul_(self._masks[1])
                y[:d, col:col + b.shape[1]].addmm_(xa, b[:m])
                col += b.shape[1]
        for first, end, slot in self.segments:
            col = 0
            for p, b in enumerate(bs):
                rows = slice((p * self.slots.max_loras + slot) * R, (p * self.slots.max_loras + slot + 1) * R)
                y[first:end, col:col + b.shape[1]].addmm_(F.linear(x[first:end], a[rows]), b[slot * R:(slot + 1) * R])
                col += b.shape[1]
        return y
