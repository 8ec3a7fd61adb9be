"""The model's shape: one dataclass read from a GGUF header or an HF config.json."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2)."""

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

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """2 (K and V) x layers x kv heads x (head dim x bytes + a scale's bytes): the seed's arithmetic."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        heads = d["num_attention_heads"]
        rope_scaling = d.get("rope_scaling") or None
        theta = d.get("rope_theta")
        params = d.get("rope_parameters")   # transformers >= 5 keeps theta/scaling here
        if isinstance(params, dict):
            theta = theta or params.get("rope_theta")
            if params.get("rope_type", "default") not in ("default", None):
                rope_scaling = rope_scaling or params
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", d.get("model_type") == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )
