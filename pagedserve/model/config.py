"""The model's shape: one dataclass read from a GGUF header or an HF config.json."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.kv_layout import KVLayout


@dataclass(slots=True)
class ModelConfig:
    """Hyper-parameters of a Llama-shaped decoder. The fields after `eos_token_ids` say how a family
    differs from Llama (pagedserve.model.families reads them from config.json); their defaults are Llama."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3                 # < num_heads: grouped-query attention
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # {"rope_type": "llama3", "factor": ..., ...} or None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False          # Qwen2 has a bias on q/k/v
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    arch: str = "llama"                   # the family (pagedserve.model.families.FAMILIES)
    o_proj_bias: bool = False             # Llama-style attention_bias: o_proj has one too (Qwen2: q/k/v only)
    fused_checkpoint: bool = False        # Phi-3: the checkpoint already holds qkv_proj and gate_up_proj
    mlp_act: str = "silu"                 # "gelu_tanh": Gemma's GeGLU (tanh-approximated GELU)
    qk_norm: bool = False                 # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    sandwich_norm: bool = False           # Gemma: attention and MLP outputs are normed before the residual add
    norm_plus_one: bool = False           # Gemma: RMSNorm scales by (1 + w) (folded into w at load)
    embed_scale: float = 1.0              # Gemma: sqrt(hidden); Granite: embedding_multiplier
    attn_scale: float | None = None       # None: 1/sqrt(head_dim); Gemma: query_pre_attn_scalar^-0.5; Granite's own
    residual_scale: float = 1.0           # Granite: residual_multiplier on each branch before the add
    logits_scaling: float = 1.0           # Granite: logits are divided by it
    attn_softcap: float | None = None     # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None    # Gemma 2: the same on the logits
    layer_windows: list[int] | None = None  # per layer: 0 full attention, W the last W positions (sliding window)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (unscaled)
    nope_layers: list[int] = field(default_factory=list)   # SmolLM3: layers without RoPE
    partial_rotary_factor: float = 1.0    # Phi-4-mini: RoPE on the first fraction of each head only
    original_max_position_embeddings: int | None = None    # Phi-3 longrope: short factors below, long at and above
    num_experts: int = 0                  # MoE (Mixtral, Qwen3-MoE): experts per MoE layer; 0 = a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True           # renormalise the top-k router weights (Mixtral always, Qwen3-MoE by flag)
    dense_layers: list[int] = field(default_factory=list)  # MoE models' layers with a dense MLP instead
    mrope_section: tuple[int, ...] | None = None   # Qwen2.5-VL: rotary frequencies per position row (t, h, w)
    vision: object | None = None          # the image encoder's config (model/vision.py, model/idefics3.py; None: text)

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """2 (K and V) x layers x kv heads x (head dim x bytes + a scale's bytes): the seed's arithmetic."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_layout(self) -> KVLayout:
        """How the layers share block tables: one table when every layer sees the same window, else a
        group of layers per window (core/kv_layout.py)."""
        return KVLayout.of([self.window(i) for i in range(self.num_layers)])

    def window(self, layer: int) -> int:
        """0: full attention; W: the layer attends to the last W positions only."""
        return self.layer_windows[layer] if self.layer_windows else 0
