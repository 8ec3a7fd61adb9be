"""EncoderCore: the EngineCore of an encoder model (a sentence-transformers folder: modules.json with a
BertModel / XLMRobertaModel / RobertaModel transformer, its 1_Pooling and 2_Normalize), which only embeds.

How the KV pool is skipped: an encoder's request is one whole-sequence forward with bidirectional
attention, never a decode, so nothing is kept between steps. This core builds no runner, allocates no
KV tensors and sizes no pool: its `kv` is a KVCacheManager of the smallest ledger BlockPool takes (the
null block and one other: two ids, no memory behind them, never allocated from), there so that what
reads a core (/metrics, the dashboard) reads a valid empty pool, and
its `scheduler` (a Scheduler over that empty manager) is never asked to schedule: it holds the limits
(max_num_seqs, traffic classes) the server reads. Requests queue here instead, in arrival order.

How batching works (continuous, whole sequences): each step takes queued requests in order while they
fit the step's token budget (max_num_batched_tokens) and max_num_seqs, at least one, packs their tokens
into one [tokens] batch with cu_seqlens (model/bert.py: sorted by length into padded groups of up to 32,
each group one batch through every layer, a key padding mask keeping each sequence to itself), pools each sequence's rows by its PoolingParams and finishes it in that step. Requests
that arrive while a step runs join the next one; nothing waits for a batch to drain.

Truncation: a prompt longer than the model's max_seq_length (sentence-transformers' own: its
sentence_bert_config.json, else the tokenizer's model_max_length, else the position table) is cut as
sentence-transformers' tokenizer call cuts it: its first max_seq_length - 1 tokens and its last (the
[SEP] / </s> that closes it)."""
from __future__ import annotations

import json
import os
import time
from collections import deque

import torch

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus, owner_id
from pagedserve.core.scheduler import build_scheduler
from pagedserve.engine.core import EngineCore
from pagedserve.engine.outputs import EngineCoreOutputs, RequestFailure, SeqTimes, SeqToken, StepStats
from pagedserve.errors import ParamError
from pagedserve.model.bert import load_encoder
from pagedserve.model.config import ModelConfig
from pagedserve.model.families import FAMILIES
from pagedserve.model.loader import ModelSource, read_pooling_config
from pagedserve.sampling_params import ENCODER_POOLING_TYPES, PoolingParams
from pagedserve.tokenizer import load_tokenizer


def is_encoder_folder(src: ModelSource) -> bool:
    """A sentence-transformers folder (modules.json) whose transformer is not one of the decoder families
    (families.py, by model_type): BERT-like, an encoder. load_encoder refuses the encoders it does not
    compute, naming `architectures`; a decoder family's folder (Qwen3-Embedding) stays with EngineCore."""
    if src.kind != "hf" or not os.path.isfile(os.path.join(src.path, "modules.json")):
        return False
    with open(os.path.join(src.path, "config.json")) as f:
        hf = json.load(f)
    return hf.get("model_type") not in FAMILIES


def max_seq_length(path: str, position_limit: int) -> int:
    """sentence-transformers' max_seq_length for this folder (see the module docstring)."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            with open(p) as f:
                n = json.load(f).get(key)
            if isinstance(n, int) and 0 < n < 1 << 30:
                return min(n, position_limit)
    return position_limit


class EncoderCore(EngineCore):
    pooling_types = ENCODER_POOLING_TYPES
    generates = False

    def _build(self, dtype: torch.dtype) -> None:
        args = self.args
        for name, bad in (("tensor_parallel_size", args.tensor_parallel_size != 1), ("enable_lora", args.enable_lora),
                          ("speculative_config", args.speculative_config is not None),
                          ("quantization", args.quantization not in (None, "auto", "none")),
                          ("batch_invariant", args.batch_invariant)):
            if bad:
                raise ValueError(f"{name}: {self.source.path} is an encoder (a sentence-transformers embedding "
                                 f"model), which runs without it")
        self.quantization = "none"
        try:
            self.encoder, self.encoder_config = load_encoder(self.source.path, dtype, args.device)
        except ValueError as e:
            from pagedserve.model.loader import ModelLoadError
            raise ModelLoadError(str(e)) from None
        c = self.encoder_config
        self.model = self.encoder
        self.model_config = ModelConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers,
                                        num_heads=c.num_heads, num_kv_heads=c.num_heads,
                                        head_dim=c.hidden_size // c.num_heads,
                                        intermediate_size=c.intermediate_size,
                                        max_position_embeddings=c.max_tokens, arch=c.architecture)
        self.tokenizer = load_tokenizer(self.source)
        self.model_pooling = read_pooling_config(self.source)
        self.max_model_len = max_seq_length(self.source.path, c.max_tokens)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.encoder.parameters())
        self.workspace_bytes = self.kv_cache_bytes = self.kv_block_bytes = self.kv_cache_bytes_per_token = 0
        self.kv_cache_dtype_name = "none"
        self.kv = KVCacheManager(2, args.block_size, False)     # a ledger, no memory: no pool (docstring)
        self.scheduler = build_scheduler(args, self.max_model_len, self.kv)
        self.runner = None
        self.loras = None
        self.step_cost = None
        self.startup_itl_floor_ms = None
        self.eos_token_ids = ()
        self.queue: deque[Request] = deque()

    # ------------------------------------------------------------ requests
    def precompile(self, params) -> None:
        pass

    def add(self, req: Request) -> None:
        if req.pooling is None:
            raise ParamError("model", f"model: {self.source.name} is an embedding model (an encoder); it only "
                                      "embeds (/v1/embeddings, LLM.embed), it does not generate")
        if not req.prompt_token_ids:
            raise ParamError("input", "input: an empty input has nothing to embed")
        cap = self.scheduler.cfg.max_waiting_requests
        if cap is not None and len(self.queue) >= cap:
            from pagedserve.errors import QueueFullError
            raise QueueFullError(f"the waiting queue is full ({cap} requests); retry later")
        self.queue.append(req)

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None:
        gone = set(seq_ids)
        self.queue = deque(r for r in self.queue if r.request_id not in gone)

    def held(self) -> dict[str, int]:
        return {"encoder.queue": len(self.queue)}

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    # ------------------------------------------------------------ the step
    def _take(self) -> list[Request]:
        budget, limit, batch = self.args.max_num_batched_tokens, self.args.max_num_seqs, []
        while self.queue and len(batch) < limit:
            n = len(self.queue[0].prompt_token_ids)
            if batch and n > budget:
                break
            budget -= n
            batch.append(self.queue.popleft())
        return batch

    def step(self) -> EngineCoreOutputs:
        t0 = time.perf_counter()
        batch = self._take()
        if not batch:
            return EngineCoreOutputs()
        try:
            vecs = self.embed_batch([r.prompt_token_ids for r in batch], [r.pooling for r in batch])
        except Exception as e:
            return EngineCoreOutputs(failed=tuple(owner_id(r) for r in batch), error=RequestFailure(
                "internal_error", f"the engine step running this request failed: {type(e).__name__}: {e}"))
        now = time.monotonic()
        tokens = []
        for r in batch:
            r.status = RequestStatus.FINISHED_LENGTH
            tokens.append(SeqToken(r.request_id, owner_id(r), 0, 0, None, r.status.value, None,
                                   SeqTimes(now, now, now, 0, 0)))
        step_s = time.perf_counter() - t0
        n = sum(len(r.prompt_token_ids) for r in batch)
        self.counters.steps += 1
        self.last_stats = StepStats(index=self.counters.steps, num_running=len(batch), num_waiting=len(self.queue),
                                    num_prefill_tokens=n, step_s=step_s, forward_s=step_s)
        return EngineCoreOutputs(tokens, {}, {r.request_id: v for r, v in zip(batch, vecs)})

    def embed_batch(self, prompts: list[list[int]], pooling: list[PoolingParams]) -> list[list[float]]:
        """One packed forward over these sequences, each pooled and normalized as its params say."""
        cu = [0]
        for p in prompts:
            cu.append(cu[-1] + len(p))
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.args.device)
        h = self.encoder(ids, cu).float()
        out = []
        for (s, e), p in zip(zip(cu[:-1], cu[1:]), pooling):
            rows = h[s:e]
            v = {"MEAN": lambda: rows.mean(0), "CLS": lambda: rows[0], "LAST": lambda: rows[-1],
                 "MAX": lambda: rows.max(0).values}[p.pooling_type]()
            if p.dimensions is not None:
                v = v[:p.dimensions]
            if p.normalize:
                v = torch.nn.functional.normalize(v, dim=0)
            out.append(v.cpu().tolist())
        return out
