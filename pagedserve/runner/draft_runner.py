"""Speculative decoding's draft model (method draft_model): a smaller model with the target's
tokenizer proposes each drafting sequence's next tokens before the target's forward verifies them.

Its KV cache is a pool of its own with the target's block ids: the scheduler allocates a block once
and both models write the same slots, so nothing about blocks (allocation, prefix sharing, forks,
trimming rejected drafts, preemption) is planned twice. The draft's KV is best-effort: the target's
verification makes the output exact whatever the draft proposes, so a draft whose KV is stale only
proposes worse tokens. The scheduler keeps each sequence's `num_draft_computed` (the positions the
draft's KV holds) and hands the draft the tokens it lacks (`ScheduledSeq.draft_prefix`): at a
sequence's first drafting step its whole context, later the one token it never read (the last draft
of a run that was accepted whole), after a preemption everything again.

Per step, for the sequences whose drafts are DRAFT_PENDING: pass 1 reads each one's prefix and its
current token (as prefill chunks, or decode rows when only the current token is new) and proposes
its first draft; pass j (up to the longest draft) feeds draft j - 1 of the sequences that draft at
least j tokens, one decode row each, and proposes draft j. What it proposes:
- a sampled, unseeded row: a token drawn from the draft's distribution q under the request's
  temperature, top-k, top-p and min-p; q is kept for the verification (`draft_probs`), which accepts
  it with probability min(1, p/q) and otherwise samples the residual max(p - q, 0)
  (runner/sampler.py: speculative_sample). Where the draft agrees with the target in distribution,
  nearly every draft is accepted at any temperature.
- a greedy row, or a seeded one: the draft's argmax (q = 1 on it), verified by the sampler's rule as
  n-gram drafts are (accepted_run). A seeded request's output then does not depend on the drafting
  (its generator is rewound past unused draws), which a sampled proposal would break."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.kv_layout import KVLayout
from pagedserve.core.step import ScheduledSeq, SchedulerOutput, whole
from pagedserve.errors import ParamError
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.loader import load_model, resolve_model
from pagedserve.model.quant import choose_quantization, weight_bytes
from pagedserve.runner.input_batch import InputBatch
from pagedserve.runner.model_runner import ModelRunner
from pagedserve.runner.sampler import sampling_probs
from pagedserve.tokenizer import load_tokenizer

log = logging.getLogger("pagedserve")
CATCH_UP_ROWS = 1024        # the most rows one reading pass takes (a long context is read in several)


class DraftRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_cache_dtype: torch.dtype):
        # the draft's own runner: its weights, and its KV pool over the target's block ids, one table for
        # all its layers (a window is applied by the attention's mask; the KV behind it is kept)
        self.runner = ModelRunner(model, num_blocks, block_size, 0, kv_cache_dtype=kv_cache_dtype,
                                  layout=KVLayout.uniform(model.cfg.num_layers))
        self.model = model
        self.propose_s = 0.0             # the last step's proposing time
        self.generator = torch.Generator().manual_seed(0x5EED)     # sampled proposals
        # the last step's sampled proposals: request id -> (k, V) the distributions its drafts came from
        self.draft_probs: dict[str, torch.Tensor] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    def apply_copies(self, ops) -> None:
        """The step's copy-on-write block copies in the draft's pool too (swaps are not mirrored: a
        preempted sequence's draft reads its context again)."""
        if ops.copy:
            self.runner.apply_block_ops(BlockOps(copy=ops.copy))

    def _pass(self, seqs: list[ScheduledSeq], batch: InputBatch) -> list[tuple[str, int, torch.Tensor | None]]:
        """One forward of the draft over these records (their block tables: the target's, in `batch`):
        (request id, proposed token, the distribution q it was drawn from, or None for an argmax) of
        each record that samples."""
        r = self.runner
        seqs = sorted(seqs, key=lambda s: not s.is_decode)       # the runner's order: decode rows first
        input_ids, positions, md, rows, _, _, _, _ = r.prepare(SchedulerOutput(tuple(seqs)), batch)
        dev = r.device
        hidden = self.model(input_ids.to(dev), positions.to(dev), r.kv_caches, md, None)
        if not rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)]).float().cpu()
        samplers = [s.sampling for s in seqs if s.sampling is not None]
        tokens = logits.argmax(dim=-1).tolist()
        qs: list[torch.Tensor | None] = [None] * len(tokens)
        drawn = [i for i, row in enumerate(samplers)
                 if row.params is not None and not row.params.greedy and row.generator_seed is None]
        if drawn:
            q = sampling_probs(logits[drawn], [samplers[i].params for i in drawn], [False] * len(drawn))
            picks = torch.multinomial(q, 1, generator=self.generator).squeeze(1).tolist()
            for n, i in enumerate(drawn):
                tokens[i], qs[i] = picks[n], q[n]
        return list(zip((row.request_id for row in samplers), tokens, qs))

    @torch.inference_mode()
    def propose(self, so: SchedulerOutput, batch: InputBatch) -> SchedulerOutput:
        """The step with every DRAFT_PENDING token replaced by the draft model's proposal. `batch`: the
        target runner's, already updated by this step (the draft's KV uses the same block ids)."""
        todo = [s for s in so.seqs if s.draft_prefix is not None and s.num_draft]
        self.propose_s = 0.0
        self.draft_probs = {}
        if not todo:
            return so
        t0 = time.perf_counter()
        drafts: dict[str, list[int]] = {s.request_id: [] for s in todo}
        qs: dict[str, list[torch.Tensor]] = {}
        # pass 1 (in pieces of at most CATCH_UP_ROWS rows per sequence): the prefix, then the current token
        pieces = []
        for s in todo:
            toks = s.draft_prefix + s.token_ids[:1]
            first = s.start - len(s.draft_prefix)
            chunks = [(a, toks[a:a + CATCH_UP_ROWS]) for a in range(0, len(toks), CATCH_UP_ROWS)]
            pieces.append([ScheduledSeq(s.request_id, c, first + a, (),
                                        s.sampling if a + len(c) == len(toks) else None) for a, c in chunks])
        for round_ in range(max(len(p) for p in pieces)):
            for rid, tok, q in self._pass([p[round_] for p in pieces if round_ < len(p)], batch):
                drafts[rid].append(tok)
                if q is not None:
                    qs.setdefault(rid, []).append(q)
        # passes 2..k: each sequence's last draft, one decode row, while it wants more
        for j in range(1, max(s.num_draft for s in todo)):
            step = [ScheduledSeq(s.request_id, (drafts[s.request_id][-1],), s.start + j, (), s.sampling)
                    for s in todo if s.num_draft > j]
            for rid, tok, q in self._pass(step, batch):
                drafts[rid].append(tok)
                if q is not None:
                    qs.setdefault(rid, []).append(q)
        self.draft_probs = {rid: torch.stack(q) for rid, q in qs.items()}
        seqs = tuple(replace(s, token_ids=s.token_ids[:1] + tuple(drafts[s.request_id]))
                     if s.request_id in drafts else s for s in so.seqs)
        self.propose_s = time.perf_counter() - t0
        return replace(so, seqs=seqs)

    def take_probs(self) -> dict[str, torch.Tensor]:
        """The last step's sampled proposals and their distributions, for its verification (then dropped)."""
        got, self.draft_probs = self.draft_probs, {}
        return got

    @torch.inference_mode()
    def measure(self, rows: list[int], block_ids: tuple[int, ...], sampling) -> tuple[list[float], float]:
        """Seconds of one proposing pass of r decode rows (r sequences, one token each), for each r, and
        seconds per token of reading a context (one chunk filling block_ids); the best of two after a
        warm-up. Writes slots of `block_ids` only (blocks the caller holds)."""
        n = len(block_ids) * self.runner.block_size
        tables = InputBatch(1)                   # every row on block_ids, for these passes only

        def run(seqs: list[ScheduledSeq]) -> float:
            tables.update(SchedulerOutput(tuple(seqs)))
            t0 = time.perf_counter()
            self._pass(seqs, tables)
            return time.perf_counter() - t0

        def decode(r: int) -> list[ScheduledSeq]:
            return [ScheduledSeq(f"draft-profile-{i}", (0,), i % n, whole((block_ids,)), sampling) for i in range(r)]
        read = [ScheduledSeq("draft-profile", (0,) * n, 0, whole((block_ids,)), sampling)]
        run(decode(1))
        run(read)
        return [min(run(decode(r)), run(decode(r))) for r in rows], min(run(read), run(read)) / n


def load_draft(spec, args, dtype: torch.dtype, layout: KVLayout, target_cfg, target_tokenizer) -> LlamaForCausalLM:
    """The draft model of speculative method draft_model, in this engine's dtype, weights packed or
    dense by the same rule as the target's; ValueError naming speculative_config.model when it cannot
    draft for this target (another tokenizer or vocabulary, or a target whose layers keep windows)."""
    field = "speculative_config.model"
    if layout.windows != (0,):
        raise ParamError(field, f"{field}: a draft model needs one block table of full-attention layers, and this "
                         f"model's layers keep attention windows ({layout.describe()}); pass "
                         "--disable-hybrid-kv-cache-manager, or use method 'ngram'")
    try:
        src = resolve_model(spec.model)
    except (OSError, ValueError) as e:
        raise ParamError(field, f"{field}: {e}") from None
    # its own "auto" ignores --dtype float32's exactness (a draft need not be exact): packed + a dense copy
    quant, dense_copy, _ = choose_quantization(spec.quantization or args.quantization, src.kind,
                                               "auto" if spec.quantization == "auto" else args.dtype, args.device, 1)
    if quant == "gguf" and src.kind != "gguf":
        raise ParamError("speculative_config.quantization", "speculative_config.quantization 'gguf' keeps a GGUF "
                         f"file's blocks packed, but the draft {spec.model} is an HF folder")
    # its activations int8-rounded wherever its weights are packed: a draft need not be exact
    model, cfg = load_model(src, dtype, args.device, quant, None, quant != "none", dense_copy)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ParamError(field, f"{field}: the draft's vocabulary has {cfg.vocab_size} tokens, the target's "
                         f"{target_cfg.vocab_size}: a draft model must share the target's tokenizer")
    if load_tokenizer(src).get_vocab() != target_tokenizer.get_vocab():
        raise ParamError(field, f"{field}: the draft's tokenizer differs from the target's (same vocabulary "
                         "size, other tokens): a draft model must share the target's tokenizer")
    log.info("speculative decoding: draft model %s (%s, %d layers, quantization %s, %.0f MiB of weights; its KV "
             "shares the target's blocks: the memory plan's weights and bytes per token include it)", spec.model,
             src.kind, cfg.num_layers, quant, weight_bytes(model) / 2**20)
    return model


__all__ = ["DraftRunner", "load_draft"]
