"""The typed records that cross the scheduler -> runner -> scheduler boundary. The runner sees
only these (never a live `Request`); each is immutable and holds plain ids and ints."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.core.kv_cache_manager import BlockOps, TableDelta
from pagedserve.core.record import record
from pagedserve.core.request import MMFeature, Request, rope_shift
from pagedserve.sampling_params import PoolingParams, SamplingParams


DRAFT_PENDING = -1      # a draft token the runner's draft model has yet to propose (ScheduledSeq.draft_prefix)


def whole(block_tables) -> tuple[TableDelta, ...]:
    """Whole block tables (one per group) as deltas from nothing: for callers that build a step by hand."""
    return tuple(TableDelta(0, tuple(t)) for t in block_tables)


@dataclass(slots=True)
class Logprob:
    """One token's log-probability and rank at a position (vLLM's shape), as the sampler returns them and the
    frontend's outputs carry them."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@record
class SamplingRow:
    """What the sampler needs about one sequence that samples this step."""

    request_id: str
    params: SamplingParams | None       # None in the copy tensor-parallel workers get (they never sample)
    generator_seed: int | None          # per-request generator; None: the sampler's shared one
    num_samples: int                    # > 1 only at the first token of an n > 1 request (it forks)
    num_output_tokens: int              # for min_tokens
    eos_token_ids: tuple[int, ...]
    history: tuple[int, ...] = ()       # prompt + output ids, only when a penalty needs them
    num_prompt_tokens: int = 0

    def for_workers(self) -> SamplingRow:
        """What a rank that does not sample needs: how many logit rows (num_samples)."""
        return replace(self, params=None, history=(), eos_token_ids=())

    @classmethod
    def of(cls, req: Request) -> SamplingRow:
        p = req.params
        penalties = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        return cls(req.request_id, p, req.generator_seed, req.num_pending_forks + 1, req.num_output_tokens,
                   req.eos_token_ids, tuple(req.all_token_ids) if penalties else (), req.num_prompt_tokens)


@dataclass(slots=True, frozen=True)
class PromptLogprobsRow:
    """Prompt logprobs from this chunk: rows first..first+len(targets)-1 of the chunk predict `targets`
    (the prompt tokens after them); `k` top logprobs each besides the target's own."""

    first: int                          # offset of the first such row within the chunk
    targets: tuple[int, ...]
    k: int


@dataclass(slots=True, frozen=True)
class PoolRow:
    """Hidden states to pool from this chunk (an embedding request): rows first..first+count-1."""

    first: int                          # offset within the chunk
    count: int
    final: PoolingParams | None = None  # on the chunk that completes the pooling: how to finish the vector


@record
class ScheduledSeq:
    """One sequence's share of the step: compute `token_ids` at positions start.. of it. With
    num_draft > 0 (speculative decoding) the last num_draft of them are draft tokens: every row
    samples, and the runner returns the accepted drafts plus one token of its own."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    tables: tuple[TableDelta, ...]      # per group of layers (KVLayout), how its block table changed since the
                                        # sequence was last scheduled (one table for a model whose layers all match);
                                        # () when none changed
    sampling: SamplingRow | None        # None: a prefill chunk that does not reach the last token
    prompt_logprobs: PromptLogprobsRow | None = None
    pool: PoolRow | None = None
    num_draft: int = 0
    lora_id: int = 0                    # the LoRA adapter its rows run with (0: the base model)
    # a draft model's turn (speculative method draft_model): its num_draft draft tokens are DRAFT_PENDING
    # placeholders the runner's draft model fills before the forward, after first reading these tokens
    # (positions start - len .. start - 1: the ones its own KV lacks); None: the drafts are given
    draft_prefix: tuple[int, ...] | None = None
    mm_inputs: tuple[MMFeature, ...] = ()   # the images whose positions this chunk overlaps (their vectors
                                            # replace those rows' embeddings; encoded first if not cached)
    rope_shift: int = 0                     # M-RoPE: what the images before `start` add to its rotary positions
                                            # (core.request.rope_shift; the runner adds those in mm_inputs)

    @property
    def draft(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One query token, or one and its drafts (each draft row is a decode of its own, one position
        further): the decode attention path (the one place this question is answered)."""
        return len(self.token_ids) - self.num_draft == 1

    def for_workers(self) -> ScheduledSeq:
        return self if self.sampling is None else replace(self, sampling=self.sampling.for_workers())

    @classmethod
    def of(cls, req: Request, start: int, n: int, tables: tuple[TableDelta, ...], sample: bool,
           prompt_logprobs: PromptLogprobsRow | None = None, pool: PoolRow | None = None,
           draft: tuple[int, ...] = (), draft_prefix: tuple[int, ...] | None = None,
           mm_inputs: tuple[MMFeature, ...] = ()) -> ScheduledSeq:
        return cls(req.request_id, tuple(req.all_token_ids[start:start + n]) + draft, start, tables,
                   SamplingRow.of(req) if sample else None, prompt_logprobs, pool, len(draft), req.lora_id,
                   draft_prefix, mm_inputs, rope_shift(req.mm_features, start) if req.mm_features else 0)


@dataclass(slots=True, frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...] = ()       # decodes first
    block_ops: BlockOps = field(default_factory=BlockOps)   # copies to make before the forward
    preempted: tuple[str, ...] = ()
    grammar_rows: tuple[str, ...] = ()         # sequences constrained by a grammar, in bitmask row order
    grammar_bitmask: Any = None                # (len(grammar_rows), ceil(vocab / 32)) int32: bit t = token t allowed
    num_admitted: int = 0                      # waiting requests that joined the batch this step
    finished_req_ids: tuple[str, ...] = ()     # sequences that ended since the last step: their state is dropped
    encoder_frees: tuple[str, ...] = ()        # image hashes whose encoder outputs the runner drops (encoder_cache.py)

    def for_workers(self) -> SchedulerOutput:
        """The record broadcast to tensor-parallel ranks > 0: everything the forward and the LM head
        need, no sampling parameters or grammar masks (rank 0 samples)."""
        return replace(self, seqs=tuple(s.for_workers() for s in self.seqs), grammar_rows=(), grammar_bitmask=None)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of sequences past their prompt: one each, and a speculative one's drafts."""
        return sum(s.num_tokens for s in self.seqs if s.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        """Speculative decoding: draft tokens computed this step."""
        return sum(s.num_draft for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs if not s.is_decode)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@record
class SeqUpdate:
    """One sequence's new token from a step, already applied by the scheduler."""

    request: Request             # the sequence
    row_id: str                  # the scheduled sequence whose logits the token was sampled from
    sample_index: int            # which of that row's sampled tokens: a fork's index (1..n-1 for the forks of an
    #                              n > 1 request), or the token's place in a speculative step's accepted run
    token_id: int
    finished: bool
    forked: bool = False         # request is a new fork (sample i of an n > 1 request's first token)
