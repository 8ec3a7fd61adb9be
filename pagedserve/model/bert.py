"""Encoder models (BERT, XLM-RoBERTa / RoBERTa, MPNet): bidirectional attention within each sequence, no KV
cache. A step's sequences come packed back to back ([tokens], `cu_seqlens` bounds each); their embeddings
are computed packed, then the sequences, sorted by length, are cut into groups padded to their longest
within 1.25x of their tokens, at most 32 a group (_length_groups), and each group runs every layer as one [seqs, len, hidden]
batch: one fused SDPA call per layer with a key padding mask, so every token sees every token of its own
sequence and none of another's or any padding; the real rows go back to their packed places. The arithmetic is transformers' modeling_bert.py: embeddings
word + absolute position + token type 0, LayerNorm (config's layer_norm_eps); each layer post-LN:
h = LN(h + Wo·attn(h)), h = LN(h + W2·act(W1·h)) with act the config's hidden_act (gelu: erf). XLM-RoBERTa
is the same with positions counted from padding_idx + 1 (its create_position_ids_from_input_ids on an
unpadded sequence). MPNet (modeling_mpnet.py): positions as XLM-R's, no token type embeddings, and every
layer's attention scores get a relative position bias (T5-style buckets of j - i: 32 buckets, max
distance 128, one learned value per bucket and head, computed once per forward and shared by the
layers). The weights are read under transformers' own names (BertModel.state_dict()), the pooler
(unused by sentence-transformers) dropped.

Padding: none. Sequences are packed back to back, so no token is a pad and no attention mask is needed;
positions count from the start of each sequence (as transformers' do for an unpadded sequence)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# architecture (config.json's architectures[0]) -> how positions start (True: after padding_idx)
ENCODER_ARCHITECTURES = {"BertModel": False, "XLMRobertaModel": True, "RobertaModel": True, "MPNetModel": True}
GROUP_SEQS = 32          # most sequences in one padded attention group (sentence-transformers' batch size)
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128       # modeling_mpnet's compute_position_bias defaults (not config)
_ACTS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(slots=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int            # the first token's position id (XLM-R: padding_idx + 1)
    relative_buckets: int = 0       # MPNet: buckets of its relative attention bias (0: none)

    @property
    def max_tokens(self) -> int:
        """The longest sequence its position table covers."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, hf: dict, where: str) -> EncoderConfig:
        archs = hf.get("architectures") or [hf.get("model_type")]
        arch = archs[0]
        if arch not in ENCODER_ARCHITECTURES:
            raise ValueError(f"{where}: architectures {archs!r} is not an encoder this engine computes (supported "
                             f"in a sentence-transformers folder: {', '.join(ENCODER_ARCHITECTURES)})")
        act = hf.get("hidden_act", "gelu")
        if act not in _ACTS:
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (supported: {', '.join(_ACTS)})")
        pet = hf.get("position_embedding_type", "absolute")
        if pet not in (None, "absolute"):
            raise ValueError(f"{where}: position_embedding_type {pet!r} is not supported (only absolute)")
        mpnet = arch == "MPNetModel"            # its padding_idx is 1 whatever pad_token_id says
        offset = (2 if mpnet else hf.get("pad_token_id", 1) + 1) if ENCODER_ARCHITECTURES[arch] else 0
        return cls(arch, hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
                   hf["intermediate_size"], hf["max_position_embeddings"], 0 if mpnet else hf.get("type_vocab_size", 2),
                   float(hf.get("layer_norm_eps", 1e-12)), act, offset,
                   hf.get("relative_attention_num_buckets", 32) if mpnet else 0)


class _Layer(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        H, I = c.hidden_size, c.intermediate_size
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.ln1 = nn.LayerNorm(H, eps=c.layer_norm_eps)
        self.up, self.down = nn.Linear(H, I), nn.Linear(I, H)
        self.ln2 = nn.LayerNorm(H, eps=c.layer_norm_eps)


class BertEncoder(nn.Module):
    """BertModel's last_hidden_state for packed sequences: forward(input_ids [T], cu_seqlens [n + 1])."""

    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.cfg = c
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.pos = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size) if c.type_vocab_size else None
        self.rel_bias = nn.Embedding(c.relative_buckets, c.num_heads) if c.relative_buckets else None
        self.ln = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.act = _ACTS[c.hidden_act]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        c = self.cfg
        spans = list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
        pos = torch.cat([torch.arange(e - s) for s, e in spans]).to(input_ids.device) + c.position_offset
        h = self.word(input_ids) + self.pos(pos)
        if self.token_type is not None:
            h = h + self.token_type.weight[0]
        h = self.ln(h)
        nh, hd = c.num_heads, c.hidden_size // c.num_heads
        bias = None
        if self.rel_bias is not None:              # [heads, n, n] of the longest; a shorter one's is its corner
            n = max(e - s for s, e in spans)
            r = torch.arange(n, device=h.device)
            bias = self.rel_bias(_bucket(r[None, :] - r[:, None])).permute(2, 0, 1).to(h.dtype)
        out = torch.empty_like(h)
        for g in _length_groups(spans):             # each group padded once, through every layer
            grp = _Group(g, h.device, h.dtype, bias)
            x = h[grp.index]                                                        # [n, len, hidden]
            n, ln = grp.index.shape
            for L in self.layers:
                q, k, v = (p(x).view(n, ln, nh, hd).transpose(1, 2) for p in (L.q, L.k, L.v))
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=grp.mask, scale=1 / math.sqrt(hd))
                x = L.ln1(x + L.o(o.transpose(1, 2).reshape(n, ln, c.hidden_size)))
                x = L.ln2(x + L.down(self.act(L.up(x))))
            out[grp.rows] = x.reshape(-1, c.hidden_size)[grp.valid]
        return out


def _length_groups(spans: list[tuple[int, int]], slack: float = 1.25) -> list[list[tuple[int, int]]]:
    """The step's sequences by length, cut into groups of at most GROUP_SEQS whose padded size (members x
    longest) stays within `slack` of their tokens: one attention call per group, little work on padding."""
    out, group, tokens = [], [], 0
    for s, e in sorted(spans, key=lambda se: se[1] - se[0]):
        n = e - s
        if group and ((len(group) + 1) * n > slack * (tokens + n) or len(group) == GROUP_SEQS):
            out.append(group)
            group, tokens = [], 0
        group.append((s, e))
        tokens += n
    if group:
        out.append(group)
    return out


class _Group:
    """Sequences padded to one length (`index`: [n, len] packed row of each position, 0 on padding);
    `mask` hides the padding keys (and adds MPNet's bias); `valid` picks the real positions of the padded
    rows, which are packed rows `rows`. Padding rows are computed and dropped: no real row sees them."""

    def __init__(self, spans: list[tuple[int, int]], device, dtype: torch.dtype, bias: torch.Tensor | None):
        n = max(e - s for s, e in spans)
        lens = torch.tensor([e - s for s, e in spans], device=device)
        starts = torch.tensor([s for s, _ in spans], device=device)
        r = torch.arange(n, device=device)
        keep = r[None, :] < lens[:, None]                                       # [seqs, len]
        self.index = torch.where(keep, starts[:, None] + r[None, :], 0)
        self.valid = keep.reshape(-1).nonzero().squeeze(1)
        self.rows = self.index.reshape(-1)[self.valid]
        self.mask = None
        if not bool(keep.all()) or bias is not None:
            m = torch.zeros(keep.shape, device=device, dtype=dtype).masked_fill(~keep, float("-inf"))
            self.mask = m[:, None, None, :] + (0 if bias is None else bias[None, :, :n, :n])


def _bucket(rel: torch.Tensor) -> torch.Tensor:
    """MPNet's relative_position_bucket (T5's bidirectional buckets) of relative positions j - i."""
    half = MPNET_BUCKETS // 2
    n = -rel
    ret = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(MPNET_MAX_DISTANCE / exact) * (half - exact)).long()
    large = torch.clamp(large, max=half - 1)
    return ret + torch.where(n < exact, n, large)


_RENAMES = (("encoder.relative_attention_bias.", "rel_bias."),
            ("attention.attn.q.", "q."), ("attention.attn.k.", "k."), ("attention.attn.v.", "v."),
            ("attention.attn.o.", "o."), ("attention.LayerNorm.", "ln1."),
            ("embeddings.word_embeddings.", "word."), ("embeddings.position_embeddings.", "pos."),
            ("embeddings.token_type_embeddings.", "token_type."), ("embeddings.LayerNorm.", "ln."),
            ("attention.self.query.", "q."), ("attention.self.key.", "k."), ("attention.self.value.", "v."),
            ("attention.output.dense.", "o."), ("attention.output.LayerNorm.", "ln1."),
            ("intermediate.dense.", "up."), ("output.dense.", "down."), ("output.LayerNorm.", "ln2."),
            ("encoder.layer.", "layers."))


def _our_name(key: str) -> str | None:
    for prefix in ("bert.", "roberta.", "mpnet.", "model."):         # a task model's base, saved under its prefix
        key = key.removeprefix(prefix)
    if key.startswith("pooler.") or key.endswith("position_ids") or key.startswith(("lm_head.", "cls.")):
        return None
    for a, b in _RENAMES:
        key = key.replace(a, b)
    return key


def load_encoder(path: str, dtype: torch.dtype, device: str) -> tuple[BertEncoder, EncoderConfig]:
    """The encoder in an HF folder (config.json + *.safetensors), its weights under transformers' names."""
    from safetensors.torch import load_file
    with open(os.path.join(path, "config.json")) as f:
        cfg = EncoderConfig.from_hf(json.load(f), f"{path}/config.json")
    sd = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            for k, t in load_file(os.path.join(path, name)).items():
                ours = _our_name(k)
                if ours is not None:
                    sd[ours] = t
    model = BertEncoder(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: the weights do not match {cfg.architecture} (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    return model.to(device=device, dtype=dtype).eval(), cfg
