"""The model runner owns every tensor: weights, the paged KV cache, the host swap tier. Per step:
block copies -> inputs (one flattened batch) -> model -> logits of sampling rows -> sampler.
It reads only the step's immutable records (`pagedserve.core.step`), never a live Request.

Under tensor parallelism every rank runs one: each holds its slice of the weights and of the KV
heads, with the same block ids; all run the same step record; only rank 0 gets logits and samples."""
from __future__ import annotations

import importlib.util
import itertools
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagedserve.core.kv_layout import KVLayout
from pagedserve.core.step import PoolRow, PromptLogprobsRow, SamplingRow, SchedulerOutput
from pagedserve import kernels
from pagedserve.errors import EngineDeadError
from pagedserve.model.attention import AttentionMetadata, LayerKV, kv_scale_bytes
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.lora import LoRABatch, LoRASlots, LoRAWeights
from pagedserve.runner import cuda_graphs
from pagedserve.runner.cuda_graphs import DecodeGraphs
from pagedserve.runner.input_batch import InputBatch
from pagedserve.runner.sampler import Logprob, SampledToken, Sampler, logprobs_of
from pagedserve.sampling_params import PoolingParams


PROMPT_LOGPROBS_ROWS = 32       # prompt rows whose logits exist at once (49k vocabulary: 6 MiB)


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)   # request id -> samples (n on a fork)
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)  # request id -> this chunk's
    embeddings: dict[str, list[float]] = field(default_factory=dict)   # request id -> its pooled vector, once complete
    forward_s: float = 0.0
    propose_s: float = 0.0           # a draft model's proposing passes (in prepare_s too)
    prepare_s: float = 0.0
    sample_s: float = 0.0


def _untouched_zeros(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are not touched until used: calloc (numpy's zeros) maps fresh zero
    pages for a large buffer, where torch.zeros writes every byte, so a 4 GiB pool counted 4 GiB of RSS at
    start-up whatever the requests used. Aligned to 64 bytes, as torch's own buffers are."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    off = -raw.ctypes.data % 64
    return torch.from_numpy(raw[off:off + nbytes]).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 seed: int = 0, kv_cache_dtype: torch.dtype | None = None, layout: KVLayout | None = None,
                 attention_backend: str = "auto", decode_graphs: tuple[int, int] | None = None,
                 rows_as_decode: bool = False):
        """decode_graphs: (max_num_seqs, max_model_len) to capture decode steps as CUDA graphs where they
        can be (runner/cuda_graphs.py); None: every step eager. rows_as_decode (--batch-invariant): every
        token of a prompt chunk is a decode row too (its own context length, the chunk's block table), so
        each row meets the same kernels whatever its chunk, its step or a preemption's recompute."""
        cfg = model.cfg
        self.model = model
        self.tp_size = model.tp.size
        self.num_kv_heads = cfg.num_kv_heads // self.tp_size      # this rank's KV heads
        self.block_size = block_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_dtype = kv_cache_dtype or self.dtype
        # the pool: K and V of each layer plane, (planes, 2, blocks, block_size, kv heads, head dim), and
        # for int8 one float32 scale per token and kv head; the host swap tier has the same layout. A
        # plane per layer when one block table serves every layer; else layer i lives in plane
        # layout.layer_plane[i] of the blocks in its group's table (core/kv_layout.py)
        self.layout = layout or cfg.kv_layout
        self.kv_cache, self.kv_scales = self._alloc(num_blocks, self.device)
        self.host_cache, self.host_scales = self._alloc(num_host_blocks, torch.device("cpu"))
        self.kv_caches = [LayerKV(self.kv_cache[j, 0], self.kv_cache[j, 1],
                                  *((self.kv_scales[j, 0], self.kv_scales[j, 1]) if self.kv_scales is not None else ()))
                          for j in self.layout.layer_plane]
        self.sampler = Sampler(seed)
        self.batch = InputBatch(self.layout.num_groups)   # the running sequences' block tables, kept across steps
        self.rows_as_decode = rows_as_decode
        self.pool_sums: dict[str, tuple[torch.Tensor, int]] = {}   # embedding requests pooled over chunks so far
        # images' encoder outputs (image_seq_len, hidden) by content hash; which are kept is the scheduler's
        # decision (core/encoder_cache.py): each step record names those to drop
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoder_runs = 0                       # images encoded (a cached image is not encoded again)
        # Gemma 3: an image's tokens attend to each other both ways in prefill (model/gemma3_vision.py)
        vision_cfg = getattr(getattr(model, "vision", None), "cfg", None)
        self.two_way_images = bool(getattr(vision_cfg, "bidirectional", False))
        # Qwen2.5-VL: rotary positions past and at images are not the token index (model/qwen2_5_vl.py); a
        # draft model's runner fed the same records keeps its own (the index)
        self.mrope = bool(model.cfg.mrope_section)
        self.attention_backend = self._attention_backend(attention_backend)
        self.use_native = self.attention_backend == "native"
        self.use_triton = self.attention_backend == "triton"
        if self.use_native:
            kernels.set_threads(torch.get_num_threads())
        self.native_prefill = self.use_native and kernels.native_prefill_pays()
        # a bf16 model on a bf16 cache: prefill attention may multiply in bf16 too (its activations are)
        self.bf16_dots = (self.native_prefill and self.dtype == self.kv_dtype == torch.bfloat16
                          and kernels.bf16_dots())
        self.lora: LoRASlots | None = None            # LoRA adapters (enable_lora)
        self.drafter = None                           # runner.draft_runner.DraftRunner (speculative draft_model)
        self.graphs: DecodeGraphs | None = None       # decode steps replayed from CUDA graphs
        why_not = "off" if decode_graphs is None else cuda_graphs.why_not(model, self)
        if why_not is None:
            self.graphs = DecodeGraphs(model, self.kv_caches, *decode_graphs, block_size, self.device)
        self.graphs_note = f"decode batch sizes {self.graphs.sizes}" if self.graphs else why_not

    def _attention_backend(self, want: str) -> str:
        """native (the C kernels: CPU), triton (CUDA; on the CPU Triton's interpreter, for tests) or torch;
        auto: native where it takes the cache, triton on CUDA where triton is installed, else torch."""
        cfg = self.model.cfg
        native = (self.device.type == "cpu" and self.kv_dtype in kernels.KV_CODES
                  and kernels.supports(cfg.head_dim, cfg.num_heads // self.tp_size, self.num_kv_heads)
                  and kernels.load() is not None)
        triton = importlib.util.find_spec("triton") is not None
        if want == "auto":
            return "native" if native else "triton" if self.device.type == "cuda" and triton else "torch"
        if want == "native" and not native:
            raise ValueError("attention_backend native: the C attention kernels need the CPU, a compiler and a "
                             f"head shape they take (head_dim {cfg.head_dim}, KV cache {self.kv_dtype})")
        if want == "triton" and not triton:
            raise ValueError("attention_backend triton: triton is not installed")
        if want not in ("native", "triton", "torch"):
            raise ValueError(f"attention_backend must be one of auto, native, triton, torch (got {want!r})")
        return want

    # ------------------------------------------------------------ LoRA adapters
    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        self.lora = LoRASlots(self.model.cfg, max_loras, max_rank, self.dtype, self.device)

    def add_lora(self, lora_id: int, weights: LoRAWeights) -> None:
        self.lora.add(lora_id, weights)

    def remove_lora(self, lora_id: int) -> None:
        self.lora.remove(lora_id)

    def _alloc(self, num_blocks: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.model.cfg
        shape = (self.layout.planes, 2, num_blocks, self.block_size, self.num_kv_heads)
        pin = device.type == "cpu" and self.device.type == "cuda"     # the swap tier of a GPU pool: pinned
        zeros = _untouched_zeros if device.type == "cpu" and not pin else \
            (lambda shp, dt: torch.zeros(shp, dtype=dt, device=device, pin_memory=pin))
        data = zeros(shape + (cfg.head_dim,), self.kv_dtype)
        scales = zeros(shape, torch.float32) if kv_scale_bytes(self.kv_dtype) else None
        return data, scales

    @torch.inference_mode()
    def touch_blocks(self, block_ids: list[int]) -> None:
        """Write zeros into these blocks of the pool (every plane, K and V, their scales): a CPU pool is mapped
        lazily, and the start-up step-time probe must read memory where it reads a context, not the zero page."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        for t in (self.kv_cache, self.kv_scales):
            if t is not None:
                t.index_fill_(2, idx, 0)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv_cache, self.kv_scales) if t is not None)

    # ------------------------------------------------------------ block copies
    def apply_block_ops(self, ops) -> None:
        pairs = [(self.kv_cache, self.host_cache)]
        if self.kv_scales is not None:
            pairs.append((self.kv_scales, self.host_scales))
        for dev_t, host_t in pairs:
            if ops.swap_out:
                dev, host = zip(*ops.swap_out)
                host_t[:, :, list(host)] = dev_t[:, :, list(dev)].to("cpu")
            if ops.swap_in:
                host, dev = zip(*ops.swap_in)
                dev_t[:, :, list(dev)] = host_t[:, :, list(host)].to(self.device)
            if ops.copy:
                src, dst = zip(*ops.copy)
                dev_t[:, :, list(dst)] = dev_t[:, :, list(src)]

    # ------------------------------------------------------------ inputs
    def prepare(self, so: SchedulerOutput, batch: InputBatch | None = None) -> tuple[
            torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[SamplingRow],
            list[tuple[str, int, PromptLogprobsRow]], list[tuple[str, int, PoolRow]], LoRABatch | None]:
        """Decode rows first (the scheduler lists them first), then prefill chunks. Block tables and
        slots come from the persistent batch (self.batch, already updated by this step's record: see
        execute), gathered by row. The attention metadata: one for every layer, or with several groups
        of layers (KVLayout) one per layer (each group's slots and block tables differ)."""
        batch = self.batch if batch is None else batch
        ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        rows: list[int] = []                                          # each sequence's row in the batch
        num_dec = 0                                                   # sequences with decode rows (they lead)
        pre_lens: list[int] = []
        cu_q = [0]
        logit_rows: list[int] = []
        sample_rows: list[SamplingRow] = []
        prompt_rows: list[tuple[str, int, PromptLogprobsRow]] = []    # (request id, first hidden row, what)
        pool_rows: list[tuple[str, int, PoolRow]] = []                 # (request id, first hidden row, what)
        row_loras: list[int] | None = None                            # with LoRA: each row's adapter (0: none)
        seqs = so.seqs
        if self.lora is not None:      # prefill chunks of one adapter adjacent (LoRABatch multiplies runs)
            seqs, row_loras = sorted(seqs, key=lambda s: (not s.is_decode, s.lora_id)), []
        row_of = batch.row_of
        spans: list[tuple[int, int, int]] = []                         # two-way image rows: (first row, rows, last key)
        for s in seqs:
            start, n = s.start, s.num_tokens
            row0 = len(ids)
            ids.extend(s.token_ids)
            starts.append(start)
            lens.append(n)
            rows.append(row_of[s.request_id])
            if row_loras is not None:
                row_loras.extend([s.lora_id] * n)
            if s.is_decode or self.rows_as_decode:   # with drafts: a decode row per token, each seeing one more
                assert not pre_lens, "decode rows come before prefill chunks"
                num_dec += 1
            else:
                pre_lens.append(start + n)
                cu_q.append(cu_q[-1] + n)
                if self.two_way_images and s.mm_inputs:
                    spans.extend(_image_spans(s, row0))
            if s.num_draft:            # speculative: every row samples, row i after i accepted drafts
                logit_rows.extend(range(row0 + n - 1 - s.num_draft, row0 + n))
                sample_rows.extend(_draft_rows(s.sampling, s.draft))
            elif s.sampling is not None:
                k = s.sampling.num_samples
                logit_rows.extend([row0 + n - 1] * k)
                sample_rows.extend([s.sampling] * k)
            if s.prompt_logprobs is not None:
                prompt_rows.append((s.request_id, row0 + s.prompt_logprobs.first, s.prompt_logprobs))
            if s.pool is not None:
                pool_rows.append((s.request_id, row0 + s.pool.first, s.pool))
        # the LM head runs on the sampling rows and on the prompt rows that want logprobs, in one call
        for _, first, plp in prompt_rows:
            logit_rows.extend(range(first, first + len(plp.targets)))
        pos, mds = self._metadata(batch, np.array(starts, dtype=np.int64), np.array(lens, dtype=np.int64),
                                  np.array(rows, dtype=np.int64), num_dec, pre_lens, cu_q)
        if spans:                      # each prefill query's last key: its own position, or its image's last
            n_dec = sum(lens[:num_dec])
            limits = pos[n_dec:].copy()
            for row, k, last in spans:
                limits[row - n_dec:row - n_dec + k] = last
            for m in mds:
                m.prefill_key_limits = torch.from_numpy(limits)
        md = mds[0] if len(mds) == 1 else [mds[g] for g in self.layout.layer_group]
        lora = self.lora.batch(row_loras, sum(lens[:num_dec])) if self.lora is not None else None
        if self.mrope and any(s.rope_shift or s.mm_inputs for s in seqs):     # past or at an image
            pos = _mrope_positions(seqs, pos)
        return (torch.tensor(ids, dtype=torch.long), torch.from_numpy(pos), md, logit_rows, sample_rows,
                prompt_rows, pool_rows, lora)

    def _metadata(self, batch: InputBatch, starts: np.ndarray, lens: np.ndarray, rows: np.ndarray, num_dec: int,
                  pre_lens: list[int], cu_q: list[int]) -> tuple[np.ndarray, list[AttentionMetadata]]:
        """Positions and, per group, slots and block tables, gathered from the batch's rows: a decode
        row gets its sequence's whole table, a prefill chunk the blocks its context fills (the rest the
        null block), each padded with the null block to the widest."""
        bs = self.block_size
        first = np.cumsum(lens) - lens                       # each sequence's first row
        tok_seq = np.repeat(np.arange(len(lens)), lens)     # each row's sequence
        pos = np.arange(int(lens.sum()), dtype=np.int64) - first[tok_seq] + starts[tok_seq]
        tok_row = rows[tok_seq]
        n_dec = int(lens[:num_dec].sum())                    # decode rows
        dec_lens = pos[:n_dec] + 1
        dec_t = torch.from_numpy(dec_lens) if n_dec else None
        cu_t, pre_t = (torch.tensor(cu_q, dtype=torch.long), torch.tensor(pre_lens, dtype=torch.long)) if pre_lens \
            else (None, None)
        need = -(-np.array(pre_lens, dtype=np.int64) // bs)  # blocks each prefill chunk's context fills
        # Triton's grids are sized on the host (no read-back of the device's tensors): the step's maxima
        maxima = dict(max_decode_context=int(dec_lens.max()) if n_dec else 0,
                      max_prefill_q=max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)) if self.use_triton else {}
        mds = []
        for table, num_blocks in zip(batch.tables, batch.num_blocks):
            slots = table[tok_row, pos // bs] * bs + pos % bs
            dec_tables = pre_tables = None
            if n_dec:                      # entries past a row's end are 0 already (InputBatch)
                dec_tables = torch.from_numpy(table[tok_row[:n_dec], :int(num_blocks[rows[:num_dec]].max())])
            if pre_lens:
                pre = table[rows[num_dec:], :int(need.max())]
                pre[np.arange(pre.shape[1]) >= need[:, None]] = 0
                pre_tables = torch.from_numpy(pre)
            mds.append(AttentionMetadata(torch.from_numpy(slots), n_dec, dec_tables, dec_t, pre_tables, cu_t, pre_t,
                                         native=self.use_native, native_prefill=self.native_prefill,
                                         bf16_dots=self.bf16_dots, triton=self.use_triton, **maxima))
        return pos, mds

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[int], prompt_rows) -> dict[str, list[dict[int, Logprob]]]:
        """Each prompt row's logprob of the prompt token that follows it, with its rank and the top k.
        The LM head and the softmax run PROMPT_LOGPROBS_ROWS rows at a time: a step's transient memory
        stays the same whatever the prompt's length (a 2,000-token prompt's logits at once would be 375
        MiB with a 49k vocabulary, and each new prompt length a new high-water mark for the allocator).
        Under tensor parallelism every rank runs the same chunks (the LM head gathers across ranks)."""
        owner = [(rid, t, plp.k) for rid, _, plp in prompt_rows for t in plp.targets]   # per row, as `rows`
        out: dict[str, list[dict[int, Logprob]]] = {}
        for c in range(0, len(rows), PROMPT_LOGPROBS_ROWS):
            idx = torch.tensor(rows[c:c + PROMPT_LOGPROBS_ROWS], dtype=torch.long, device=hidden.device)
            logits = self.model.compute_logits(hidden[idx], prompt=True)
            if logits is None:                          # a tensor-parallel rank > 0
                continue
            lp = torch.log_softmax(logits.cpu().float(), dim=-1)
            i = 0
            for rid, same in itertools.groupby(owner[c:c + PROMPT_LOGPROBS_ROWS], key=lambda o: o[0]):
                same = list(same)                       # the chunk's rows of one request, in order
                out.setdefault(rid, []).extend(logprobs_of(lp[i:i + len(same)], [t for _, t, _ in same], same[0][2]))
                i += len(same)
        return out

    def held(self) -> dict[str, int]:
        """Per-request entries the runner keeps (0 once every request has ended and been reported)."""
        return {**self.sampler.held(), "runner.pool_sums": len(self.pool_sums), "runner.batch_rows": len(self.batch)}

    # ------------------------------------------------------------ images
    def _embeds(self, so: SchedulerOutput, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The rows' input embeddings with each image's vectors at its positions (HF LLaVA's
        masked_scatter), the images not cached encoded first, in one batch; None: no image this step
        (the model embeds the ids itself). Rows are in so.seqs order (no LoRA beside images)."""
        if not any(s.mm_inputs for s in so.seqs):
            return None
        new = {f.hash: f for s in so.seqs for f in s.mm_inputs if f.hash not in self.encoder_cache}
        if new:
            data = [f.data for f in new.values()]       # pixels; LLaVA-NeXT: an image's patches and size each
            inputs = torch.stack(data).to(self.device) if isinstance(data[0], torch.Tensor) else \
                [d.to(self.device) for d in data]
            for h, v in zip(new, self.model.vision(inputs)):
                self.encoder_cache[h] = v
            self.encoder_runs += len(new)
        x = self.model.embed_input(input_ids)
        row = 0
        for s in so.seqs:
            for f in s.mm_inputs:                # the overlap of the image's positions and the chunk's
                lo, hi = max(f.offset, s.start), min(f.end, s.start + s.num_tokens)
                x[row + lo - s.start:row + hi - s.start] = self.encoder_cache[f.hash][lo - f.offset:hi - f.offset]
            row += s.num_tokens
        return x

    # ------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        for rid in so.finished_req_ids:           # ended since the last step: nothing of theirs is kept
            self.sampler.forget(rid)
            self.pool_sums.pop(rid, None)
        self.batch.update(so)                     # rows out (ended, preempted), new rows, changed tables
        for h in so.encoder_frees:                # images the scheduler's encoder cache evicted
            self.encoder_cache.pop(h, None)
        self.apply_block_ops(so.block_ops)
        if not so.seqs:
            return out
        t0 = time.perf_counter()
        if self.drafter is not None:                  # a draft model proposes the step's pending drafts
            self.drafter.apply_copies(so.block_ops)
            so = self.drafter.propose(so, self.batch)
            out.propose_s = self.drafter.propose_s
        elif any(s.draft_prefix is not None for s in so.seqs):
            raise RuntimeError("the step has draft tokens for a draft model to propose, and this runner has none")
        input_ids, positions, md, rows, sample_rows, prompt_rows, pool_rows, lora = self.prepare(so)
        dev = self.device
        if dev.type != "cpu":
            input_ids, positions = input_ids.to(dev), positions.to(dev)
            md = _to_device(md, dev) if isinstance(md, AttentionMetadata) else _to_device_per_layer(md, dev)
        t1 = time.perf_counter()
        try:
            embeds = self._embeds(so, input_ids) if getattr(self.model, "vision", None) is not None else None
            if embeds is None and self.graphs is not None and lora is None and self.graphs.takes(input_ids.shape[0], md):
                hidden = self.graphs.run(input_ids, positions, md)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, md, lora, embeds=embeds)
            n = len(sample_rows)
            prompt = (md if isinstance(md, AttentionMetadata) else md[0]).num_prefills > 0
            logits = self.model.compute_logits(hidden[torch.tensor(rows[:n], dtype=torch.long, device=dev)],
                                               prompt) if n else None
            if prompt_rows:
                out.prompt_logprobs = self._prompt_logprobs(hidden, rows[n:], prompt_rows)
            for rid, first, pool in pool_rows:       # embeddings: the final-normed hidden states, summed
                h = self.model.final_norm(hidden[first:first + pool.count]).float().sum(0).cpu()
                s, rows = self.pool_sums.pop(rid, (0.0, 0))
                if pool.final is None:
                    self.pool_sums[rid] = (h + s, rows + pool.count)
                else:
                    out.embeddings[rid] = _pooled((h + s) / (rows + pool.count), pool.final)
        except Exception as e:
            if self.tp_size == 1:
                raise
            # the other ranks may be waiting in a collective this rank never reached: nothing local is left
            raise EngineDeadError(f"a tensor-parallel forward failed on this rank ({type(e).__name__}: {e}); "
                                  "the ranks are out of step") from e
        t2 = time.perf_counter()
        if logits is not None:
            drafts = {s.request_id: s.draft for s in so.seqs if s.num_draft}
            draft_probs = self.drafter.take_probs() if self.drafter is not None else None
            samples = self.sampler.sample_on_device(logits, sample_rows, _grammar_masks(so, sample_rows),
                                                    keep_states=drafts, draft_probs=draft_probs) if sample_rows else []
            for row, smp in zip(sample_rows, samples):
                out.sampled.setdefault(row.request_id, []).append(smp)
            for rid, draft in drafts.items():
                out.sampled[rid] = self.sampler.verify(rid, draft, out.sampled[rid])
        t3 = time.perf_counter()
        out.prepare_s, out.forward_s, out.sample_s = t1 - t0, t2 - t1, t3 - t2
        return out


def _pooled(mean: torch.Tensor, pooling: PoolingParams) -> list[float]:
    """An embedding request's vector: the mean (or the one row) of its pooled hidden states, cut to
    `dimensions`, L2-normalized when asked."""
    if pooling.dimensions is not None:
        mean = mean[:pooling.dimensions]
    if pooling.normalize:
        mean = torch.nn.functional.normalize(mean, dim=0)
    return mean.tolist()


def _image_spans(s, row0: int) -> list[tuple[int, int, int]]:
    """The rows of a prefill chunk that lie in an image (first row, rows, the image's last position).
    The scheduler never ends a chunk inside an image, so every key up to that position is written."""
    out = []
    for f in s.mm_inputs:
        lo, hi = max(f.offset, s.start), min(f.end, s.start + s.num_tokens)
        if hi != f.end:
            raise RuntimeError(f"a prefill chunk ends at {hi} inside an image at {f.offset}..{f.end - 1} whose tokens "
                               "attend both ways (the scheduler's EncoderCacheManager.whole keeps them whole)")
        out.append((row0 + lo - s.start, hi - lo, f.end - 1))
    return out


def _mrope_positions(seqs, index: np.ndarray) -> np.ndarray:
    """The rows' rotary positions under M-RoPE (Qwen2.5-VL) from their token indices (`index`, in seqs'
    row order): a text token's index plus the shifts of the images before it (ScheduledSeq.rope_shift for
    those before the chunk, then each image of the chunk's mm_inputs it follows); an image token's
    three rows (p, p + row, p + col), p the position its image's first token would have as text (HF's
    get_rope_index). 1-D when the step has no image token (every row equal: decode keeps its fast paths),
    else (3, T)."""
    pos, three, row = index.copy(), [], 0
    for s in seqs:
        n = s.num_tokens
        idx, shift = index[row:row + n], s.rope_shift
        pos[row:row + n] += shift
        for f in s.mm_inputs:
            if not f.grid:
                continue
            inside = np.flatnonzero((idx >= f.offset) & (idx < f.end))
            if inside.size:                # its rows (temporal, height, width) from its first position p
                j, p = idx[inside] - f.offset, f.offset + shift
                three.append((row + inside, np.stack((np.full_like(j, p), p + j // f.grid[1], p + j % f.grid[1]))))
            shift += f.rope_shift
            pos[row:row + n][idx >= f.end] += f.rope_shift
        row += n
    if not three:
        return pos
    out = np.repeat(pos[None], 3, axis=0)
    for rows, p in three:
        out[:, rows] = p
    return out


def _draft_rows(row: SamplingRow, draft: tuple[int, ...]) -> list[SamplingRow]:
    """The sampling rows of a speculative sequence: row i samples as if drafts 1..i had been accepted
    (min_tokens and penalties see them)."""
    rows = [row]
    for i in range(1, len(draft) + 1):
        rows.append(replace(row, num_output_tokens=row.num_output_tokens + i,
                            history=row.history + draft[:i] if row.history else ()))
    return rows




def _grammar_masks(so: SchedulerOutput, sample_rows: list[SamplingRow]) -> tuple[list[int], np.ndarray] | None:
    """(sample row indices, their packed masks) for the constrained rows (an n > 1 fork's rows share one)."""
    if not so.grammar_rows:
        return None
    where = {rid: i for i, rid in enumerate(so.grammar_rows)}
    idx = [(r, where[row.request_id]) for r, row in enumerate(sample_rows) if row.request_id in where]
    return [r for r, _ in idx], so.grammar_bitmask[[m for _, m in idx]]


def _to_device_per_layer(mds: list[AttentionMetadata], dev) -> list[AttentionMetadata]:
    moved = {id(md): _to_device(md, dev) for md in mds}       # one copy per group, not per layer
    return [moved[id(md)] for md in mds]


def _to_device(md: AttentionMetadata, dev) -> AttentionMetadata:
    for name in ("slot_mapping", "decode_block_tables", "decode_context_lens", "prefill_block_tables",
                 "prefill_cu_q", "prefill_context_lens", "prefill_key_limits"):
        v = getattr(md, name)
        if v is not None:
            setattr(md, name, v.to(dev, non_blocking=True))
    return md
