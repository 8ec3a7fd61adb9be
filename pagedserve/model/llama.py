"""A Llama-shaped decoder over one flattened token batch and a paged KV cache.

RMSNorm, RoPE (pagedserve.model.rope), SwiGLU MLP, grouped-query attention, tied or untied LM head.
q/k/v and gate/up projections are fused into one matmul each: fewer, larger GEMMs. The other
families (pagedserve.model.families) are this model with a few differences switched on: Qwen3's
q/k norms, Gemma's sandwich norms, GeGLU, scalings, soft-caps and sliding windows, Granite's
multipliers, SmolLM3's NoPE layers, Phi-3's partial RoPE, Mixtral's and Qwen3-MoE's experts.
"""
from __future__ import annotations

import ctypes
import itertools
import math
import os
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import kernels
from pagedserve.distributed.group import TPGroup
from pagedserve.distributed.sharding import vocab_slice
from pagedserve.host import cpu_info
from pagedserve.model.attention import AttentionMetadata, LayerKV, paged_attention, write_kv
from pagedserve.model.config import ModelConfig
from pagedserve.model.gemm import Warmup, gemm, padded, pads_rows
from pagedserve.model.lora import LoRABatch
from pagedserve.model.quant import FORMATS as QFORMATS, Packed, PackedParts, interleaves, packed_rows, uncopied_rows
from pagedserve.model.rope import rope_tables


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, transposed: bool = False,
           prompt: bool = False) -> torch.Tensor:
    """x @ w.T. With `transposed`, batches of 2..128 rows are computed as (w @ x.T).T: MKL runs that
    up to 3x faster than F.linear on some CPUs (AMD EPYC: 3 rows x the 49152-row LM head, 10 ms vs
    31 ms) and 2-3x slower on others (Intel Xeon with AVX-512), so LlamaForCausalLM.choose_gemm_form()
    measures both on the model's own weights when it is loaded. A PackedWeight (--quantization)
    multiplies itself (`prompt`: the step carries prompt rows, see Packed.matmul). Rows are padded to a bucket where the GEMM library keeps state per shape
    (pagedserve.model.gemm)."""
    if isinstance(w, Packed):
        return w.matmul(x, b, prompt)
    if not transposed or not 2 <= x.shape[0] <= 128 or x.device.type != "cpu":
        return gemm(x, w, b)
    y = (w @ padded(x).t()).t()[: x.shape[0]].contiguous()
    return y if b is None else y + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class MoE(nn.Module):
    """Mixtral / Qwen3-MoE sparse MLP: a softmax router picks each row's top-k experts (weights
    renormalised over the k where the family does); the experts run grouped, each on all of the
    batch's rows routed to it (one gate/up and one down matmul per used expert, not a loop over rows)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k, self.renormalize, self.act = cfg.num_experts_per_tok, cfg.norm_topk_prob, ACTIVATIONS[cfg.mlp_act]
        self.router = nn.Parameter(torch.empty(e, h))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * inter, h))      # (experts, gate rows + up rows, hidden)
        self.down = nn.Parameter(torch.empty(e, h, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(gemm(x, self.router).float(), dim=-1)         # (T, experts), float32 as HF
        weights, experts = torch.topk(probs, self.top_k, dim=-1)                # (T, k)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        order = torch.argsort(experts.flatten(), stable=True)                  # (row, slot) pairs by expert
        rows, weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(torch.bincount(experts.flatten(), minlength=self.router.shape[0]).tolist()):
            if n:
                r = rows[start:start + n]
                gate, up = gemm(x[r], self.gate_up[e]).chunk(2, dim=-1)
                y = gemm(self.act(gate) * up, self.down[e]) * weights[start:start + n, None]
                out.index_add_(0, r, y.to(out.dtype))
                start += n
        return out


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


PRODUCTS = ("qkv", "o", "gate_up", "down")     # a layer's `{p}_proj`, dlayer_t's fields, LoRASlots' keys


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream. What a family changes is an
    attribute here, None where it does not apply: per-head q/k norms, norms after each branch
    (sandwich), the attention scale, a sliding window, a soft-cap, a residual multiplier, an MoE MLP.

    Under tensor parallelism (tp.size = N) the layer holds 1/N of the heads and of the MLP
    (pagedserve.distributed.sharding) and all-reduces the outputs of o_proj and down_proj."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, index: int):
        super().__init__()
        h, hd, n = cfg.hidden_size, cfg.head_dim, tp.size
        self.tp = tp
        self.n_heads, self.n_kv, self.hd, self.eps = cfg.num_heads // n, cfg.num_kv_heads // n, hd, cfg.rms_norm_eps
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(hd)
        self.window, self.softcap, self.residual_scale = cfg.window(index), cfg.attn_softcap, cfg.residual_scale
        self.index = index
        self.act = ACTIVATIONS[cfg.mlp_act]
        self.attn_norm = nn.Parameter(torch.empty(h))
        self.qkv_proj = nn.Linear(h, (self.n_heads + 2 * self.n_kv) * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=cfg.o_proj_bias)
        self.q_norm = nn.Parameter(torch.empty(hd)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(hd)) if cfg.qk_norm else None
        self.post_attn_norm = nn.Parameter(torch.empty(h)) if cfg.sandwich_norm else None
        self.mlp_norm = nn.Parameter(torch.empty(h))
        self.post_mlp_norm = nn.Parameter(torch.empty(h)) if cfg.sandwich_norm else None
        self.moe = MoE(cfg) if cfg.is_moe and index not in cfg.dense_layers else None
        if self.moe is None:
            inter = cfg.intermediate_size // n
            self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False)
            self.down_proj = nn.Linear(inter, h, bias=False)
        self.transposed = False        # small-batch GEMM form, see linear()
        self.ops = None                # the layer_ops kernels, when this layer takes the native float32 path

    def products(self) -> list[nn.Module]:
        """This layer's projections, in PRODUCTS order (an MoE layer has no gate_up / down: its experts')."""
        return [getattr(self, f"{p}_proj") for p in PRODUCTS if hasattr(self, f"{p}_proj")]

    def native_ok(self) -> bool:
        """Whether _forward_native computes this layer: float32, and glue_ok()."""
        return self.attn_norm.dtype == torch.float32 and self.glue_ok()

    def glue_ok(self) -> bool:
        """Whether the native glue (kernels/layer_ops.c) can compute this layer in float32: on the CPU, and
        none of the family options it leaves to torch (q/k norms, sandwich norms, soft-caps, MoE, an
        activation other than SiLU)."""
        return (self.attn_norm.device.type == "cpu" and self.q_norm is None and self.post_attn_norm is None
                and self.post_mlp_norm is None and self.softcap is None and self.moe is None
                and self.act is F.silu and self.hd <= 256)

    def forward(self, x, rope, kv: LayerKV, md: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """`lora`: the step's adapters (model/lora.py), added to each adapted product's output."""
        if self.ops is not None and not md.triton:
            return self._forward_native(x, rope, kv, md, lora)
        T, tr, nh, i, pr = x.shape[0], self.transposed, self.n_heads, self.index, md.num_prefills > 0
        h = rms_norm(x, self.attn_norm, self.eps)
        qkv = _adapted(lora, linear(h, self.qkv_proj.weight, self.qkv_proj.bias, tr, pr), h, i, "qkv")
        n_qk = nh + self.n_kv
        qk = qkv[:, : n_qk * self.hd].view(T, n_qk, self.hd)
        if self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :nh], self.q_norm, self.eps), rms_norm(qk[:, nh:], self.k_norm, self.eps)), 1)
        if rope is not None:                                    # None: a NoPE layer
            qk = apply_rope(qk, *rope)                          # q and k at once
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, n_qk * self.hd:].view(T, self.n_kv, self.hd)
        write_kv(kv, k, v, md.slot_mapping, md.triton)
        o = paged_attention(q, kv, md, self.scale, self.window, self.softcap).reshape(T, -1)
        x = self._add(x, self.tp.all_reduce(_adapted(lora, linear(o, self.o_proj.weight, self.o_proj.bias, tr, pr), o,
                                                     i, "o")), self.post_attn_norm)
        h = rms_norm(x, self.mlp_norm, self.eps)
        if self.moe is not None:
            return self._add(x, self.moe(h), self.post_mlp_norm)
        gate, up = _adapted(lora, linear(h, self.gate_up_proj.weight, None, tr, pr), h, i, "gate_up").chunk(2, dim=-1)
        a = self.act(gate) * up
        return self._add(x, self.tp.all_reduce(_adapted(lora, linear(a, self.down_proj.weight, None, tr, pr), a, i,
                                                        "down")), self.post_mlp_norm)

    def _forward_native(self, x, rope, kv: LayerKV, md: AttentionMetadata, lora: LoRABatch | None) -> torch.Tensor:
        """forward() with the work between the products in one native call each (kernels/layer_ops.c):
        the same float32 arithmetic, ~6 calls a layer where torch dispatches ~25 ops."""
        T, tr, ops, i, pr = x.shape[0], self.transposed, self.ops, self.index, md.num_prefills > 0
        x = x.contiguous()
        _, h = kernels.add_rms_norm(x, self.attn_norm, self.eps, lib=ops)
        qkv = _adapted(lora, linear(h, self.qkv_proj.weight, self.qkv_proj.bias, tr, pr), h, i, "qkv")
        q = kernels.rope_kv(qkv, *(rope or (None, None)), kv.k, kv.v, kv.k_scale, kv.v_scale, md.slot_mapping,
                            self.n_heads, self.n_kv, self.hd, lib=ops)
        o = paged_attention(q, kv, md, self.scale, self.window).view(T, -1)
        y = self.tp.all_reduce(_adapted(lora, linear(o, self.o_proj.weight, self.o_proj.bias, tr, pr), o, i,
                                        "o")).contiguous()
        x, h = kernels.add_rms_norm(x, self.mlp_norm, self.eps, y if self.residual_scale == 1.0 else
                                    y * self.residual_scale, lib=ops)
        a = kernels.silu_mul(_adapted(lora, linear(h, self.gate_up_proj.weight, None, tr, pr), h, i, "gate_up"), lib=ops)
        d = self.tp.all_reduce(_adapted(lora, linear(a, self.down_proj.weight, None, tr, pr), a, i, "down"))
        return x.add_(d if self.residual_scale == 1.0 else d * self.residual_scale)

    def _add(self, x: torch.Tensor, branch: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        if post_norm is not None:
            branch = rms_norm(branch, post_norm, self.eps)
        return x + (branch if self.residual_scale == 1.0 else branch * self.residual_scale)


def _adapted(lora: LoRABatch | None, y: torch.Tensor, x: torch.Tensor, layer: int, product: str) -> torch.Tensor:
    """A product's output y = x @ W.T with the step's LoRA deltas added (none: y itself)."""
    return y if lora is None else lora.add(y, x, layer, product)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on the first cos.shape[-1] dims of each head (all of them but for Phi-4-mini)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    r = x[..., :rot]
    return torch.cat((r * cos + _rotate_half(r) * sin, x[..., rot:]), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaForCausalLM(nn.Module):
    """forward() returns hidden states of every row; compute_logits() runs the LM head on the few
    rows that will sample. `cfg` is the whole model's shape; under tensor parallelism this rank
    holds its slice of the vocabulary and of every layer, and logits come back on rank 0 only."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TPGroup.single()
        self.vocab_first, self.vocab_end, vocab_rows = vocab_slice(cfg.vocab_size, tp.rank, tp.size)
        # its weight given, not drawn: nn.Embedding's normal_ init on the meta device imports torch._dynamo
        # (1.5-6 s of start-up, issue 56) for values the load replaces anyway
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size, _weight=torch.empty(vocab_rows, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.ropes, self.rope_keys = rope_tables(cfg)       # host arithmetic: built on the CPU, even under meta
        self.transposed = False        # small-batch GEMM form of the LM head, see linear()
        self.fused: FusedDecode | None = None     # few-row decode steps in one native call (choose_decode_path)
        self.vision: nn.Module | None = None      # a vision-language model's image encoder (model/vision.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                md: AttentionMetadata | list[AttentionMetadata], lora: LoRABatch | None = None,
                max_position: int | None = None, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """md: one for every layer, or one per layer (layers in different KV groups read different block
        tables: core/kv_layout.py). lora: the step's LoRA adapters by row (model/lora.py), or None.
        max_position: a bound on `positions` (runner/cuda_graphs.py: nothing read back while capturing).
        embeds: the rows' input embeddings when the runner built them (embed_input's, image vectors at image
        tokens)."""
        mds = md if isinstance(md, list) else itertools.repeat(md)
        x = self.embed_input(input_ids) if embeds is None else embeds     # (T, hidden)
        dt, dev = self.norm.dtype, self.norm.device     # the compute dtype (the embedding may be packed)
        if self.fused is not None and self.fused.takes(x, md, lora):
            return self.fused.run(x, positions, kv_caches, md, lora)
        ropes = {k: table(positions, dt, dev, max_position) for k, table in self.ropes.items()}  # (T, 1, rot)
        for layer, key, kv, layer_md in zip(self.layers, self.rope_keys, kv_caches, mds):
            x = layer(x, None if key is None else ropes[key], kv, layer_md, lora)
        return x

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: the embeddings, scaled where the family scales them (Gemma, Granite).
        Image vectors are written over these, after the scaling (HF Gemma 3's masked_scatter)."""
        x = self.embed(input_ids)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # vocab-parallel: each rank looks up the ids in its slice, zeros elsewhere; the sum is exact
        mine = (input_ids >= self.vocab_first) & (input_ids < self.vocab_end)
        x = self.embed_tokens(torch.where(mine, input_ids - self.vocab_first, 0))
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last hidden states (what HF's base model returns): the final norm applied."""
        return rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)

    @property
    def head_weight(self):
        """The LM head's matrix: the embedding's when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, prompt: bool = False) -> torch.Tensor | None:
        """Float32 logits (rows, vocab); under tensor parallelism on rank 0 only (None elsewhere).
        `prompt`: the rows come from a step that carries prompt rows (see Packed.matmul)."""
        h = self.final_norm(hidden)
        w = self.head_weight
        logits = self.tp.gather_columns(linear(h, w, None, self.transposed, prompt).float())
        if logits is None:
            return None
        logits = logits[:, :self.cfg.vocab_size]
        if self.cfg.logits_scaling != 1.0:                                 # Granite
            logits = logits / self.cfg.logits_scaling
        if self.cfg.final_softcap is not None:                             # Gemma 2
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits

    def _dense_probes(self) -> list[torch.Tensor]:
        """The matrices the GEMM-form measurement times: the first dense MLP's (an MoE model may have none;
        a mixed GGUF file may keep only some products dense) and the LM head, where they are dense."""
        mlps = [layer.gate_up_proj.weight for layer in self.layers if layer.moe is None]
        others = [m.weight for layer in self.layers for m in layer.products()]
        probes = [w for w in mlps + others if not isinstance(w, Packed)][:1]
        return probes + ([] if isinstance(self.head_weight, Packed) else [self.head_weight])

    def choose_layer_path(self) -> str:
        """Layers that can (DecoderLayer.native_ok) take the native float32 path between their products,
        unless PAGEDSERVE_LAYER_OPS=torch. Returns the line logged at load."""
        forced = os.environ.get("PAGEDSERVE_LAYER_OPS", "native") == "torch"
        can = [layer.native_ok() for layer in self.layers]
        lib = None if forced or not any(can) else kernels.load(source="layer_ops")
        for layer, ok in zip(self.layers, can):
            layer.ops = lib if ok else None
        why = ("PAGEDSERVE_LAYER_OPS=torch" if forced else "no C compiler" if any(can) and lib is None else
               "float32 layers without q/k norms, sandwich norms, soft-caps or MoE take it")
        n = sum(layer.ops is not None for layer in self.layers)
        return f"layer glue: native in {n} of {len(self.layers)} layers ({why})"

    def choose_decode_path(self) -> str:
        """Few-row decode steps run every layer in one native call (FusedDecode) where each layer's glue
        can be native and its products are packed, unless PAGEDSERVE_FUSED_DECODE=0 or
        PAGEDSERVE_LAYER_OPS=torch. Returns the line logged at load."""
        self.fused = None
        for var, off in (("PAGEDSERVE_FUSED_DECODE", "0"), ("PAGEDSERVE_LAYER_OPS", "torch")):
            if os.environ.get(var) == off:
                return f"decode steps: layer by layer ({var}={off})"
        why = FusedDecode.refusal(self)
        if why is not None:
            return f"decode steps: layer by layer ({why})"
        self.fused = FusedDecode(self)
        return (f"decode steps: every layer in one native call for up to {self.fused.max_rows} rows (packed "
                f"products, native glue in float32{'' if self.norm.dtype == torch.float32 else ', the residual stream too'})")

    @torch.inference_mode()
    def choose_gemm_form(self, int8_act: bool = False, packed_rows: int | None = None) -> str:
        """The small-batch form of dense products (batches of 2..128 rows): (w @ x.T).T on AMD hosts,
        F.linear elsewhere (measured on the two kinds: AMD EPYC 3 rows x the LM head 10 ms vs 31 ms,
        Intel Xeon with AVX-512 2-3x the other way); by the host's kind, not timed at load, so every start
        computes the same numbers. PAGEDSERVE_SMALL_M_GEMM=linear|transposed decides instead. Packed
        weights: the rows they take (_set_packed_rows; `packed_rows` pins them). Returns the line logged."""
        forced = os.environ.get("PAGEDSERVE_SMALL_M_GEMM")
        if forced not in (None, "linear", "transposed"):
            raise ValueError(f"PAGEDSERVE_SMALL_M_GEMM must be linear or transposed, got {forced!r}")
        head = self.head_weight
        packed = any(isinstance(m.weight, Packed) for layer in self.layers for m in layer.products()) or \
            isinstance(head, Packed)
        lines = [self._set_packed_rows(head, int8_act, packed_rows)] if packed else []
        probes = self._dense_probes()
        if not probes:
            return "; ".join(lines)
        if probes[0].device.type != "cpu":
            return "; ".join(lines + ["small-batch GEMMs: F.linear (not on CPU)"])
        if forced:
            use, why = forced == "transposed", "PAGEDSERVE_SMALL_M_GEMM"
        else:              # by the host's kind, not a timing: a timed choice may flip between starts
            use = "AMD" in cpu_info()[0]
            why = "the host kind's form: AMD's MKL runs (w @ x.T).T up to 3x faster, Intel's F.linear"
        self.transposed = use
        for layer in self.layers:
            layer.transposed = use
        return "; ".join(lines + [f"small-batch GEMMs: {'(w @ x.T).T' if use else 'F.linear'} ({why})"])

    def gemm_warmup(self, max_rows: int, head_rows: int) -> Warmup:
        """The job building the GEMM library's kernels for every row bucket a step can reach (gemm.Warmup):
        the layers' products up to max_rows (the step's token budget), the LM head up to head_rows (the
        most rows a step samples or scores at once). Only where products are padded to buckets (bf16 /
        fp16 through oneDNN); not a tensor-parallel model's (its head gathers across ranks) nor MoE
        experts' (rows per expert: built as steps meet them); where none is built ahead, an empty job saying why."""
        dtype = self.norm.dtype
        if not pads_rows(dtype, self.norm.device.type):
            return Warmup(note="nothing to build ahead (this dtype keeps no per-shape state here)")
        if self.tp.size > 1:
            return Warmup(note="built as steps meet them (tensor parallel)")
        products = []

        def add(w, b, transposed: bool, last: int) -> None:
            if isinstance(w, Packed):   # packed up to small_m decode rows; prompt steps and more rows: many-row path
                key = ("packed", w.fmt, w.shape, None if w.dense is None else w.dense.dtype, b is None)
                copy = w.dense is not None
                products.append((key, lambda x: w.matmul(x, b, prompt=copy), w.K, dtype, 0 if copy else w.small_m, last))
            else:
                key = ("dense", tuple(w.shape), w.stride(), w.dtype, b is None, transposed)
                products.append((key, lambda x: linear(x, w, b, transposed), w.shape[1], dtype, 0, last))
        for layer in self.layers:
            for mod in layer.products():
                add(mod.weight, mod.bias, layer.transposed, max_rows)
        add(self.head_weight, None, self.transposed, head_rows)
        return Warmup(products)

    def _set_packed_rows(self, head, int8_act: bool, forced: int | None = None) -> str:
        """Packed weights: their activations (int8-rounded or float), the 8-row interleave for int8, and the
        decode rows up to which qmatmul takes them (quant.packed_rows: the host kind's table, or pinned); a
        weight without a dense copy takes every step's rows up to quant.uncopied_rows, prompt rows too."""
        layer_ws = [m.weight for layer in self.layers for m in layer.products() if isinstance(m.weight, Packed)]
        rows, head_rows, why = packed_rows(int8_act, forced)
        bare = uncopied_rows(int8_act, forced)      # a weight without a dense copy, prompt rows too (None: as m)
        lines = []
        for name, ws, m in (("layers", layer_ws, rows), ("LM head", [head] if isinstance(head, Packed) else [], head_rows)):
            for w in ws:
                w.int8_act, w.small_m = int8_act, m if w.dense is not None or bare is None else max(m, bare)
                if interleaves(int8_act):
                    w.interleave()
            if ws:
                n = 0 if bare is None else sum(w.dense is None for w in ws)
                lines.append(f"{name} up to {m} decode rows"
                             + (f" ({max(m, bare)} rows, prompt rows too, for the {n} without a dense copy)" if n else ""))
        kernel = f"qmatmul_q8 ({kernels.load(source='qmatmul').qmatmul_q8_isa().decode()})" if int8_act else "qmatmul"
        has = {w.dense is not None for w in layer_ws + [head] if isinstance(w, Packed)}
        more = (["prompt steps and more rows: the dense copies"] if True in has else []) + \
            (["more rows: dequantized tiles"] if False in has else [])
        return f"packed kernels: {kernel} for {', '.join(lines)} ({why}); " + "; ".join(more)


class FusedDecode:
    """A step's layers in one call to layer_ops' decode_layers: the same kernels, in the same order, as
    DecoderLayer._forward_native on each layer (in float32: the same numbers), without the ~15 Python
    calls, allocations and ctypes crossings a layer costs (~0.1 ms a layer on a 2-core host: most of a
    one-row step outside the weight reads; ~10 ms of a 100-token bf16 prefill's torch glue). Taken by
    steps up to the rows the packed products are used for (Packed.small_m): decode rows (with LoRA
    rows in a float32 model too: their deltas added in C after each product, close to LoRABatch.add, not
    bit for bit) and, where the weights have no dense copies (a prompt step takes those: Packed.matmul),
    prefill chunks whose prefill attention is the native kernel too (the chunks' rows after the decode
    rows, as AttentionMetadata orders them); the layer path runs otherwise.
    In a bfloat16 / float16 model (whose layers take the torch glue) the step's residual stream, norms
    and RoPE are float32 here (the products round their input to int8 anyway; the K/V cache keeps its
    dtype): more precise than the layer path, held like it to the closeness rule.
    The weights' addresses are fixed at load (the model owns them and this object), the K/V planes' on
    the first call (the runner's pool)."""

    PRODUCTS = PRODUCTS                            # the module's: every layer's four, in dlayer_t's order

    @staticmethod
    def refusal(model: LlamaForCausalLM) -> str | None:
        """Why this model's decode steps cannot be fused (None: they can)."""
        layers = list(model.layers)
        if model.tp.size > 1:
            return "tensor parallel: the products all-reduce"
        if not all(layer.glue_ok() for layer in layers):
            return "a layer's family options need the torch glue"
        if any(layer.residual_scale != 1.0 for layer in layers):
            return "residual multipliers"
        weights = [getattr(layer, f"{p}_proj").weight for layer in layers for p in FusedDecode.PRODUCTS]
        if not all(isinstance(w, Packed) for w in weights):
            return "dense weights: the products are the GEMM library's"
        if len({w.int8_act for w in weights}) != 1:
            return "the packed products differ in kind"
        if len(set(model.rope_keys)) != 1:
            return "layers rotate with different RoPE tables"
        if any(kernels.load(source=src) is None for src in ("paged_attention", "qmatmul", "layer_ops")):
            return "the native kernels could not be built"
        if not kernels.supports(layers[0].hd, layers[0].n_heads, layers[0].n_kv):
            return "a head shape the attention kernel does not take"
        return None

    def __init__(self, model: LlamaForCausalLM):
        cfg, layers = model.cfg, list(model.layers)
        first = layers[0]
        self.lib = kernels.load(source="layer_ops")
        self.dtype = model.norm.dtype
        self.keep = []              # the norms and biases in float32 (copies, in a half-precision model)
        w0 = first.qkv_proj.weight
        weights = [getattr(layer, f"{p}_proj").weight for layer in layers for p in self.PRODUCTS]
        self.max_rows = min(w.small_m for w in weights)
        self.prompts = not any(w.dense is not None for w in weights)   # prompt steps too (none go to dense copies)
        self.rope = None if model.rope_keys[0] is None else model.ropes[model.rope_keys[0]]
        qmm = kernels.load(source="qmatmul")
        self.structs = (kernels.DecodeLayer * len(layers))()
        for ls, layer in zip(self.structs, layers):
            self.keep += [layer.attn_norm.data.float(), layer.mlp_norm.data.float()]
            ls.attn_norm, ls.mlp_norm = self.keep[-2].data_ptr(), self.keep[-1].data_ptr()
            for product in self.PRODUCTS:
                mod = getattr(layer, f"{product}_proj")
                p = getattr(ls, product)
                self._bind_parts(p, mod.weight.parts if isinstance(mod.weight, PackedParts) else [mod.weight])
                if mod.bias is not None:
                    self.keep.append(mod.bias.data.float())
                    p.bias = self.keep[-1].data_ptr()
            ls.window = layer.window
        self.stack = kernels.DecodeStack(
            layers=ctypes.addressof(self.structs),
            qmm=kernels.function_address(qmm, "qmatmul_q8" if w0.int8_act else "qmatmul"),
            attn=kernels.function_address(kernels.load(), "paged_decode_attention"),
            pattn=kernels.function_address(kernels.load(), "paged_prefill_attention"),
            L=len(layers), H=cfg.hidden_size, nh=first.n_heads, nkv=first.n_kv, hd=first.hd,
            I=first.down_proj.weight.K, block_size=0, kv=-1, eps=first.eps, scale=first.scale)
        self.seconds: ctypes.Array | None = None      # profile(): products, attention, glue
        # the K/V planes bound into the structs: (id of the runner's list, a weak reference to its first
        # plane), so an engine gone with its pool is not kept alive by a model the loader's cache keeps;
        # engines sharing this model may step in threads at once: binding and calling hold the lock
        self._bound: tuple[int, weakref.ref] | None = None
        self._lock = threading.Lock()
        self._lora_structs = (kernels.LoRAProduct * (4 * len(layers)))()
        self._lora_bound: tuple[weakref.ref, int] | None = None      # (the runner's LoRASlots, its products)

    def _bind_parts(self, p: kernels.PackedProduct, parts: list) -> None:
        """A product's packed_t: its first part, the others chained through `next` (PackedParts: each part's
        kernel writes its own columns)."""
        for i, w in enumerate(parts):
            p.w, p.row_bytes, p.fmt, p.N = w.data.data_ptr(), w.data.shape[1], QFORMATS[w.fmt][0], w.data.shape[0]
            if i + 1 < len(parts):
                nxt = kernels.PackedProduct()
                self.keep.append(nxt)
                p.next, p = ctypes.addressof(nxt), nxt

    def profile(self, on: bool = True) -> None:
        """Accumulate the seconds the fused steps spend in the products, the attention and the glue into
        self.seconds (bench/step_anatomy.py reads them); off again with on=False."""
        self.seconds = (ctypes.c_double * 3)() if on else None
        self.stack.prof = None if self.seconds is None else ctypes.addressof(self.seconds)

    def takes(self, x: torch.Tensor, md, lora: LoRABatch | None) -> bool:
        """Steps of up to max_rows rows whose attention the native kernels read: decode rows (with LoRA
        slots in float32 too) and, where the weights have no dense copies and the native prefill kernel is
        the layer path's (md.native_prefill), prefill chunks (without LoRA)."""
        if not (isinstance(md, AttentionMetadata) and md.native and x.shape[0] <= self.max_rows):
            return False
        if md.num_prefills:       # (an image's two-way span: the torch path's mask, attention.prefill_attention)
            return self.prompts and md.native_prefill and lora is None and md.prefill_key_limits is None
        return md.num_decodes == x.shape[0] and (lora is None or (
            not lora.segments and len(lora.decode_slots) == x.shape[0] and lora.slots.dtype == torch.float32))

    def _bind_lora(self, slots) -> None:
        """The runner's LoRA slot tensors, per layer and product (made as adapters first need them; their
        addresses do not move after)."""
        b = self._lora_bound
        if b is not None and b[0]() is slots and b[1] == len(slots.tensors):
            return
        for i, ls in enumerate(self.structs):
            for j, product in enumerate(self.PRODUCTS):
                ab = slots.tensors.get((i, product))
                if ab is None:
                    ls.lora[j] = None
                    continue
                a, bs = ab
                lp = self._lora_structs[4 * i + j]
                lp.a, lp.parts = a.data_ptr(), len(bs)
                for k, part in enumerate(bs):
                    lp.b[k], lp.out[k] = part.data_ptr(), part.shape[1]
                ls.lora[j] = ctypes.addressof(lp)
        self.stack.max_loras, self.stack.rank = slots.max_loras, slots.max_rank
        self._lora_bound = (weakref.ref(slots), len(slots.tensors))

    def _bind(self, kv_caches: list[LayerKV]) -> None:
        """The K/V planes the runner passes (the same list every step): their addresses and format."""
        b = self._bound
        if b is not None and b[0] == id(kv_caches) and b[1]() is kv_caches[0].k:
            return
        k0 = kv_caches[0].k
        for ls, kv in zip(self.structs, kv_caches):
            ls.k_cache, ls.v_cache = kv.k.data_ptr(), kv.v.data_ptr()
            ls.k_scale = None if kv.k_scale is None else kv.k_scale.data_ptr()
            ls.v_scale = None if kv.v_scale is None else kv.v_scale.data_ptr()
        self.stack.kv, self.stack.block_size = kernels.KV_CODES[k0.dtype], k0.shape[1]
        self._bound = (id(kv_caches), weakref.ref(k0))

    def run(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV], md: AttentionMetadata,
            lora: LoRABatch | None = None) -> torch.Tensor:
        """The hidden states after the last layer (x's dtype): x is the embedded step, updated in place."""
        x = x.float().contiguous()
        cos, sin = self.rope(positions, torch.float32, x.device) if self.rope is not None else (None, None)
        bt = md.decode_block_tables          # the decode rows' attention (none: a step of prefill chunks only)
        decodes = (bt.data_ptr(), bt.shape[1], md.decode_context_lens.data_ptr()) if md.num_decodes else (None, 0, None)
        chunks = None if not md.num_prefills else kernels.Chunks(
            md.prefill_block_tables.data_ptr(), md.prefill_cu_q.data_ptr(), md.prefill_context_lens.data_ptr(),
            md.num_prefills, md.prefill_block_tables.shape[1],
            kernels.prefill_kv_code(kv_caches[0].k.dtype, md.bf16_dots))
        row_slot = None if lora is None else (ctypes.c_int32 * x.shape[0])(*lora.decode_slots)
        with self._lock:
            self._bind(kv_caches)
            if lora is not None:
                self._bind_lora(lora.slots)
            self.stack.row_slot = None if row_slot is None else ctypes.addressof(row_slot)
            rc = self.lib.decode_layers(ctypes.addressof(self.stack), x.data_ptr(), x.shape[0],
                                        None if cos is None else cos.data_ptr(),
                                        None if sin is None else sin.data_ptr(), 0 if cos is None else cos.shape[-1],
                                        md.slot_mapping.data_ptr(), *decodes, md.num_decodes,
                                        None if chunks is None else ctypes.byref(chunks))
            self.stack.row_slot = None
        if rc != 0:
            raise MemoryError("decode_layers could not allocate its scratch")
        return x if self.dtype == torch.float32 else x.to(self.dtype)
