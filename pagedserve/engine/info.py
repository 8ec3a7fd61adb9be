"""The door between the frontend and its engine core, in values: `EngineInfo`, what the core is (its limits,
vocabulary, EOS ids, block size, traffic classes, memory), built once when the core is ready and frozen; and
`CoreStats`, what the core's state is now (the last step's record, running totals, queues, pool, classes),
made in the engine thread on request. The frontend (LLMEngine's users: the server's routes, /metrics, /debug,
the dashboard, `top`, LLM) reads these and never the core's objects, so the core can move to its own process
with no change on this side. Traffic classes and the speculative config are frozen configuration, shared as
they are."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import SpeculativeConfig
from pagedserve.core.traffic import TrafficClasses
from pagedserve.engine.outputs import EngineCounters, StepStats


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """One engine core as its frontend sees it; fixed for the core's life."""

    model_name: str                          # the model's own name (what responses report without an alias)
    model_path: str                          # its file or folder (/v1/models' root)
    arch: str                                # its architecture, as the loader named it
    generates: bool                          # False: an encoder, which only embeds
    max_model_len: int                       # resolved: --max-model-len, at most the model's context
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int                          # tokens per KV block
    num_kv_blocks: int                       # usable blocks of the pool (the null block not counted)
    vocab_size: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]           # the model's and the tokenizer's, in that order
    traffic_classes: TrafficClasses | None   # --traffic-classes (None: one class)
    speculative: SpeculativeConfig | None    # --speculative-config (None: no drafts)
    enable_lora: bool
    has_encoder_cache: bool                  # a vision-language model's encoder cache (its metrics)
    pooling_types: tuple[str, ...]           # what an embedding request may pool by
    model_pooling: dict                      # how the model says embeddings are made (loader.read_pooling_config)
    weights_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    load_s: float                            # seconds the core took to build
    startup_itl_floor_ms: float | None       # traffic classes: the ITL floor predicted at start-up

    def check_token_ids(self, param: str, ids, label: str | None = None) -> None:
        """ParamError naming `param` when an id is outside the vocabulary."""
        from pagedserve.errors import ParamError
        V = self.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ParamError(param, f"{label or param}: token id {bad[0]} is outside the vocabulary [0, {V})")

    def fit_prompt(self, ids: list[int]) -> list[int]:
        """A prompt as the core runs it: a decoder's as given; an encoder's truncated as sentence-transformers
        truncates (the first max_model_len - 1 tokens and the last)."""
        n = self.max_model_len
        return ids if self.generates or len(ids) <= n else ids[:n - 1] + ids[-1:]


@dataclass(slots=True, frozen=True)
class SpecTotals:
    """Speculative decoding's running totals (vLLM's spec_decode counters)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class EncoderCacheTotals:
    """A vision-language model's encoder cache: images read from it, images encoded, image tokens held."""

    hits: int
    misses: int
    size_tokens: int


@dataclass(slots=True, frozen=True)
class CoreStats:
    """The core's state now, in values (EngineCore.stats, in the engine thread between two steps)."""

    step: StepStats                          # the last step's record
    counters: EngineCounters                 # running totals (a copy)
    num_running: int
    num_waiting: int
    num_free_blocks: int                     # including evictable prefix-cache blocks
    num_used_blocks: int
    kv_usage: float
    spec: SpecTotals | None                  # None without speculative decoding
    encoder_cache: EncoderCacheTotals | None
    classes: tuple[dict, ...] | None         # per traffic class (Scheduler.class_summary); None without classes
    num_shared_savings: int | None = None    # blocks sharing saved (O(pool): only when asked for)
