"""Decode steps replayed from CUDA graphs (vLLM's pattern): a small decode step on a GPU is bound by kernel
launches (a 30-layer model launches ~15 kernels a layer), so the model body of a decode-only step is captured
once per batch size in GRAPH_SIZES up to max_num_seqs and replayed; prefill and mixed steps run eagerly.

A graph reads fixed addresses, so its inputs live in persistent buffers sized for the largest batch: token
ids, positions, slots, block tables (max_model_len / block_size wide) and context lengths. A step of n decode
rows copies its inputs into the first n rows and replays the smallest graph of at least n rows; the padding
rows write their K/V into slot 0 (the null block, which no context reads) and attend to that one position.
The attention kernels' grids do not depend on the step: the decode split count covers max_model_len (splits
past a row's context end at once), and RoPE's table is built to max_model_len before capture.

Captured only on CUDA with the Triton attention path, one KV group, no LoRA and no MoE (their routing reads
counts back); --enforce-eager turns it off. `capture=False` runs the same padded buffers eagerly: the CPU
tests check that path (padding rows, full-width tables, the fixed split count) against plain steps.
"""
from __future__ import annotations

import torch

from pagedserve.model.attention import AttentionMetadata


def graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, ... below max_num_seqs, then max_num_seqs."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def why_not(model, runner) -> str | None:
    """Why decode steps cannot be captured for this runner, or None. (LoRA steps never replay a graph:
    the runner passes them to the model.)"""
    if runner.device.type != "cuda":
        return "off (not on CUDA)"
    if not runner.use_triton:
        return "off (the attention path is not Triton's)"
    if runner.layout.num_groups != 1:
        return "off (layers read different block tables: KV groups)"
    if model.cfg.is_moe:
        return "off (MoE routing reads expert counts back)"
    return None


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, capture: bool = True):
        self.model, self.kv_caches = model, kv_caches
        self.sizes = graph_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        B, W = self.sizes[-1], -(-max_model_len // block_size)
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)     # noqa: E731
        self.ids, self.pos, self.slots, self.tables, self.lens = z(B), z(B), z(B), z(B, W), z(B) + 1
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0            # steps served from a graph (or, capture=False, from the padded buffers)
        if capture:
            self._capture()

    def _forward(self, b: int) -> torch.Tensor:
        md = AttentionMetadata(self.slots[:b], b, self.tables[:b], self.lens[:b], triton=True,
                               max_decode_context=self.max_model_len)
        return self.model(self.ids[:b], self.pos[:b], self.kv_caches, md, None, max_position=self.max_model_len - 1)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.sizes):           # the largest first: the smaller ones reuse its memory
                self._forward(b)                     # compiles the Triton kernels, picks the GEMMs
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[b] = self._forward(b)
                self.graphs[b] = g
        torch.cuda.synchronize()

    def takes(self, n: int, md) -> bool:
        return (isinstance(md, AttentionMetadata) and not md.num_prefills and md.num_decodes == n
                and 0 < n <= self.sizes[-1] and md.decode_block_tables.shape[1] <= self.tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states (n, hidden): its rows copied into the buffers, the graph of the smallest
        size >= n replayed (or, without capture, the model run on the padded buffers)."""
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        w = md.decode_block_tables.shape[1]
        self.ids[:n].copy_(input_ids)
        self.pos[:n].copy_(positions)
        self.slots[:n].copy_(md.slot_mapping)
        self.tables[:n, :w].copy_(md.decode_block_tables)
        self.tables[:n, w:].zero_()
        self.lens[:n].copy_(md.decode_context_lens)
        if b > n:       # padding rows: an earlier, larger step's rows would write into live slots
            self.ids[n:b].zero_()
            self.pos[n:b].zero_()
            self.slots[n:b].zero_()
            self.tables[n:b].zero_()
            self.lens[n:b].fill_(1)
        self.replays += 1
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._forward(b)[:n]
