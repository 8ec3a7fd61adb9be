"""The model runner owns every tensor: weights, the paged KV cache, the host swap tier. Per step:
block copies -> inputs (one flattened batch) -> model -> logits of sampling rows -> sampler.
It reads only the step's immutable records (`pagedserve.core.step`), never a live Request."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedserve.core.step import SamplingRow, SchedulerOutput
from pagedserve.kernels import decode_scratch, native_lib
from pagedserve.model.attention import AttentionMetadata, PrefillSeq
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.runner.sampler import SampledToken, Sampler


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)   # request id -> samples (n on a fork)
    forward_s: float = 0.0
    prepare_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 seed: int = 0):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        host_shape = (cfg.num_layers, 2, num_host_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.host_cache = torch.zeros(host_shape, dtype=self.dtype, device="cpu")
        self.sampler = Sampler(seed)
        self.use_native = self.device.type == "cpu" and self.dtype == torch.float32 and native_lib() is not None

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    # ------------------------------------------------------------ block copies
    def apply_block_ops(self, ops) -> None:
        if ops.swap_out:
            dev, host = zip(*ops.swap_out)
            self.host_cache[:, :, list(host)] = self.kv_cache[:, :, list(dev)].to("cpu")
        if ops.swap_in:
            host, dev = zip(*ops.swap_in)
            self.kv_cache[:, :, list(dev)] = self.host_cache[:, :, list(host)].to(self.device)
        if ops.copy:
            src, dst = zip(*ops.copy)
            self.kv_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)]

    # ------------------------------------------------------------ inputs
    def prepare(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                    list[SamplingRow]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        dec_tables: list[tuple[int, ...]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        logit_rows: list[int] = []
        sample_rows: list[SamplingRow] = []
        for s in so.seqs:
            start, n = s.start, s.num_tokens
            row0 = len(ids)
            if s.is_decode:
                ids.append(s.token_ids[0])
                pos.append(start)
                slots.append(s.block_ids[start // bs] * bs + start % bs)
                dec_tables.append(s.block_ids)
                dec_lens.append(start + 1)
            else:
                ids.extend(s.token_ids)
                pos.extend(range(start, start + n))
                ctx = start + n
                bt = torch.tensor(s.block_ids[: -(-ctx // bs)], dtype=torch.long)
                p = torch.arange(start, ctx)
                slots.extend((bt[p // bs] * bs + p % bs).tolist())
                mask = None
                if start:   # a cached prefix: query i sits at position start + i
                    mask = torch.arange(ctx).unsqueeze(0) <= p.unsqueeze(1)
                prefills.append(PrefillSeq(row0, row0 + n, ctx, bt, mask))
            if s.sampling is not None:
                k = s.sampling.num_samples
                logit_rows.extend([row0 + n - 1] * k)
                sample_rows.extend([s.sampling] * k)
        md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), prefills=prefills,
                               num_decodes=len(dec_lens))
        if dec_lens:
            width = max(len(t) for t in dec_tables)
            md.decode_block_tables = torch.tensor([t + (0,) * (width - len(t)) for t in dec_tables], dtype=torch.long)
            lens = torch.tensor(dec_lens, dtype=torch.long)
            md.decode_context_lens = lens
            if self.use_native:
                md.decode_scratch = decode_scratch(len(dec_lens), self.model.cfg.num_heads, width, bs)
            else:
                md.decode_mask = (torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
        return (torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), md, logit_rows, sample_rows)

    # ------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        self.apply_block_ops(so.block_ops)
        if not so.seqs:
            return out
        t0 = time.perf_counter()
        input_ids, positions, md, rows, sample_rows = self.prepare(so)
        dev = self.device
        if dev.type != "cpu":
            input_ids, positions = input_ids.to(dev), positions.to(dev)
            md = _to_device(md, dev)
        t1 = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, md)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)]) if rows else None
        t2 = time.perf_counter()
        if logits is not None:
            samples = self.sampler(logits.cpu(), sample_rows)
            for row, smp in zip(sample_rows, samples):
                out.sampled.setdefault(row.request_id, []).append(smp)
        t3 = time.perf_counter()
        out.prepare_s, out.forward_s, out.sample_s = t1 - t0, t2 - t1, t3 - t2
        return out


def _to_device(md: AttentionMetadata, dev) -> AttentionMetadata:
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens", "decode_mask"):
        v = getattr(md, name)
        if v is not None:
            setattr(md, name, v.to(dev, non_blocking=True))
    for p in md.prefills:
        p.block_ids = p.block_ids.to(dev)
        p.mask = None if p.mask is None else p.mask.to(dev)
    return md
