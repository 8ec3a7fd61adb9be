"""Engine configuration: one validated dataclass. The CLI's and the server's flags are generated
from these fields (EngineArgs.add_cli_args), never from a second hand-written list."""
from __future__ import annotations

import argparse
import json
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields

SPEC_METHODS = ("ngram", "draft_model")
SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "quantization",
             "adaptive")
MAX_SPEC_TOKENS = 16


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config. method "ngram": the longest n-gram (prompt_lookup_max down to
    prompt_lookup_min tokens) that ends the sequence and occurred earlier in it proposes the tokens
    that followed its latest earlier occurrence, up to num_speculative_tokens. method "draft_model"
    (the default when `model` is given): `model` (a GGUF file, HF folder or Hub id of a smaller model
    with the target's tokenizer) proposes its greedy tokens, for every drafting sequence in one batch,
    from a KV cache of its own held in the target's block ids; `quantization` (vLLM's key) how its
    weights are held (auto | none | gguf | int8; default: the target's --quantization rule; "auto"
    here keeps a GGUF draft packed with a dense copy even beside a --dtype float32 target, whose
    exact output it then speeds up: a draft need not be exact). adaptive (ours, default true): each step
    drafts only the tokens whose expected acceptance pays for the rows (and draft-model passes) they
    add, from the step times measured at start-up (false: always draft up to num_speculative_tokens)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    adaptive: bool = True
    model: str | None = None
    quantization: str | None = None

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A dict or its JSON text (--speculative-config); None stays None. ValueError names the key."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown key (known: {', '.join(SPEC_KEYS)})")
        method = value.get("method", "draft_model" if "model" in value else "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: unknown method {method!r} (supported: "
                             f"{', '.join(SPEC_METHODS)})")
        model = value.get("model")
        if method == "draft_model":
            if not isinstance(model, str) or not model.strip():
                raise ValueError("speculative_config.model: method 'draft_model' needs the draft model's path or Hub "
                                 f"id, got {model!r}")
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if key in value:
                    raise ValueError(f"speculative_config.{key} applies to method 'ngram', not 'draft_model'")
        else:
            for key in ("model", "quantization"):
                if key in value:
                    raise ValueError(f"speculative_config.{key} applies to method 'draft_model', not {method!r}")
        quantization = value.get("quantization")
        if quantization is not None and quantization not in ("auto", "none", "gguf", "int8"):
            raise ValueError("speculative_config.quantization must be one of auto, none, gguf, int8, got "
                             f"{quantization!r}")
        out = {}
        for key, lo, hi, default in (("num_speculative_tokens", 1, MAX_SPEC_TOKENS, 4), ("prompt_lookup_min", 1, 64, 1),
                                     ("prompt_lookup_max", 1, 64, 3)):
            v = value.get(key, default)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], got {v!r}")
            out[key] = v
        if "prompt_lookup_max" not in value and out["prompt_lookup_min"] > out["prompt_lookup_max"]:
            out["prompt_lookup_max"] = out["prompt_lookup_min"]
        if out["prompt_lookup_min"] > out["prompt_lookup_max"]:
            raise ValueError(f"speculative_config.prompt_lookup_min ({out['prompt_lookup_min']}) exceeds "
                             f"prompt_lookup_max ({out['prompt_lookup_max']})")
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        return cls(method, adaptive=adaptive, model=model, quantization=quantization, **out)


def _h(text: str, **kw) -> dict:
    return {"help": text, **kw}


@dataclass(slots=True)
class EngineArgs:
    model: str | None = field(default=None, metadata=_h(
        "GGUF file, HF folder or Hub id ORG/NAME[:QUANT] (a GGUF repository's file by quantization name, "
        "e.g. :Q4_K_M); default: the bundled SmolLM2-135M-Instruct"))
    revision: str | None = field(default=None, metadata=_h("Hub revision (branch, tag or commit) of a Hub id"))
    mmproj: str | None = field(default=None, metadata=_h(
        "llama.cpp's image encoder GGUF (mmproj) beside a GGUF text model: LLaVA-1.5's CLIP tower and projector"))
    dtype: str = field(default="auto", metadata=_h(
        "float32 | bfloat16 | float16 | auto (bfloat16 where the CPU multiplies it natively: AMX-BF16 or "
        "AVX512-BF16; float32 on other CPUs; bfloat16 on GPU). Norms, softmax, logits and sampling stay float32"))
    quantization: str = field(default="auto", metadata=_h(
        "auto (a GGUF file's quantized matrices packed for few-row steps beside a dense copy for many-row ones, "
        "on one CPU rank unless --dtype float32; dense otherwise; logged with its reason) | none (dense in "
        "--dtype) | gguf (keep only the packed matrices: the least memory) | int8 (quantize every matrix per "
        "output channel at load)"))
    packed_rows: int | None = field(default=None, metadata=_h(
        "decode rows of a step up to which packed weights take the product (default: the host kind's "
        "table, logged at load). Steps carrying prompt rows take the dense copy at any size; no timing "
        "decides either, so every start computes the same numbers"))
    batch_invariant: bool = field(default=False, metadata=_h(
        "a request's tokens and logprobs do not depend on what shares its steps, on chunk sizes or on "
        "preemption: every row through the same row-wise kernels (packed products, the decode attention "
        "kernel, the fused layer call) with a fixed reduction order; a GGUF file on one CPU rank, no LoRA "
        "(vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic inference); its cost in BENCHMARKS.md"))
    warm_gemm_shapes: bool = field(default=True, metadata=_h(
        "build the GEMM library's kernels for every row bucket a step can reach ahead (~1-2.5 s): at load, "
        "and in serve in the engine's idle time after /health is 200, so a server's memory is flat once it "
        "has idled; off: built as steps meet them (the default of generate and chat, which meet a few)"))
    kv_cache_dtype: str = field(default="auto", metadata=_h(
        "auto (as --dtype; bfloat16 on a CPU where --dtype auto is float32 for want of bf16 arithmetic, as "
        "llama.cpp keeps f16) | float32 | bfloat16 | int8 (one float32 scale per token and kv head): the KV "
        "cache's storage; bfloat16 halves the bytes per token, int8 about quarters them"))
    pooling: str | None = field(default=None, metadata=_h(
        "last | mean | cls | max (max: encoders only): how embedding requests (LLM.embed, /v1/embeddings) pool "
        "the final hidden states; "
        "default: the model's sentence-transformers pooling config, else last (normalized)"))
    device: str = field(default="cpu", metadata=_h("cpu | cuda"))
    enforce_eager: bool = field(default=False, metadata=_h(
        "CUDA: run decode steps eagerly (by default decode-only steps of up to max_num_seqs rows replay CUDA "
        "graphs captured at start-up for batch sizes 1, 2, 4, 8, ...)"))
    attention_backend: str = field(default="auto", metadata=_h(
        "auto (native on the CPU where the C kernels take the model's heads and KV format, triton on CUDA, "
        "torch otherwise) | native | triton (on the CPU: Triton's interpreter, slow; for tests) | torch "
        "(each context gathered, then SDPA: the reference)"))
    block_size: int = field(default=16, metadata=_h("tokens per KV block"))
    num_kv_blocks: int | None = field(default=None, metadata=_h("KV pool size in blocks (overrides --kv-cache-memory)"))
    kv_cache_memory: str | None = field(default=None, metadata=_h(
        "KV pool size in bytes, e.g. 2GiB; default: on the CPU 20%% of free memory, at most 4 GiB; on CUDA "
        "what --gpu-memory-utilization leaves"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_h(
        "CUDA: the share of each GPU's memory the engine may use; the KV pool gets what the weights, the "
        "workspace and other processes leave of it"))
    max_model_len: int | None = field(default=None, metadata=_h("longest prompt + output; default: the model's context, at most 8192"))
    max_num_batched_tokens: int = field(default=1024, metadata=_h("token budget of one step"))
    max_num_seqs: int = field(default=64, metadata=_h("most requests running at once"))
    enable_prefix_caching: bool = field(default=True, metadata=_h("reuse cached KV blocks of shared prefixes"))
    disable_hybrid_kv_cache_manager: bool = field(default=False, metadata=_h(
        "one block table for every layer even when layers differ in attention window (Gemma, Qwen with "
        "max_window_layers; Mistral's sliding window too): the KV behind a window is kept, as for full attention "
        "(vLLM's flag; a speculative draft model needs it for such a target)"))
    enable_chunked_prefill: bool = field(default=True, metadata=_h("split long prompts across steps"))
    long_prefill_token_threshold: int = field(default=256, metadata=_h("chunk limit: most prompt tokens one request computes per step"))
    preemption_mode: str = field(default="recompute", metadata=_h("recompute | swap, when the KV pool is full"))
    swap_space: float = field(default=1.0, metadata=_h("host-memory swap tier in GiB (preemption_mode=swap)"))
    max_waiting_requests: int | None = field(default=None, metadata=_h("bounded waiting queue; beyond it requests are rejected"))
    seed: int = field(default=0, metadata=_h("seed of the sampler's shared generator"))
    kv_allocation: str = field(default="paged", metadata=_h("paged | contiguous (reserve max_model_len tokens per request; for experiments)"))
    scheduling_policy: str = field(default="continuous", metadata=_h("continuous | static (a batch runs until its longest member ends; for experiments)"))
    num_threads: int | None = field(default=None, metadata=_h("torch CPU threads (per rank); default: all cores, "
                                                              "divided among the local tensor-parallel ranks"))
    tensor_parallel_size: int = field(default=1, metadata=_h(
        "shard the model over this many ranks (Megatron-style: heads, MLP and vocabulary split, two all-reduces "
        "per layer; gloo on CPU, NCCL on CUDA); must divide the attention heads, KV heads and MLP size"))
    speculative_config: str | dict | None = field(default=None, metadata=_h(
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": '
        '1, "prompt_lookup_max": 3}, or {"model": DRAFT, "num_speculative_tokens": 4} (method draft_model: a '
        'smaller model with the same tokenizer); each step drafts only where the expected accepted tokens pay for '
        'the rows (measured at start-up; "adaptive": false drafts always)'))
    traffic_classes: str | list | None = field(default=None, metadata=_h(
        'traffic classes, a JSON list or a file holding one: [{"name": "interactive", "priority": 0, "itl_p99_ms": '
        '150}, {"name": "batch", "priority": 10}]; keys name, priority (required), ttft_p99_ms, itl_p99_ms, '
        'max_running, max_budget_share, max_waiting, preemption_mode. A request picks one by traffic_class, the '
        'X-Traffic-Class header or its priority band; higher classes preempt lower ones, and while a class with an '
        'ITL target decodes, prefill is cut to keep the predicted step under it'))
    strict_slo: bool = field(default=False, metadata=_h(
        "refuse to start when a traffic class's itl_p99_ms is under this host's floor (the least step carrying "
        "its decode beside the other classes' least work, by the step-time model; default: a warning naming it)"))
    enable_lora: bool = field(default=False, metadata=_h(
        "serve LoRA adapters (PEFT folders) beside the base model: a request picks one by its `model` "
        "(LLM.generate: lora_request); rows of different adapters share a step"))
    lora_modules: list[str] | dict | None = field(default=None, metadata=_h(
        "adapters to load at start: NAME=PATH ... or JSON {\"name\": ..., \"path\": ...} (needs --enable-lora; "
        "more at run time with POST /v1/load_lora_adapter)"))
    max_loras: int = field(default=1, metadata=_h("most LoRA adapters among the running sequences (slots per step)"))
    max_lora_rank: int = field(default=16, metadata=_h("largest adapter rank accepted (the slots' width)"))
    max_cpu_loras: int | None = field(default=None, metadata=_h(
        "most adapters loaded at once (each holds its weights in memory); default: max_loras, the --lora-modules "
        "count, and 8 more"))
    limit_mm_per_prompt: str | dict | None = field(default=None, metadata=_h(
        'most images per prompt, vLLM\'s JSON: {"image": 2} (default 4; a vision-language model only)'))
    allowed_media_domains: list[str] | None = field(default=None, metadata=_h(
        "hosts an image_url may name (http/https); none by default: only data: URLs are taken. Fetching is not "
        "implemented, so a URL of an allowed host is refused saying so; others are refused naming the domain"))
    encoder_budget_tokens: int | None = field(default=None, metadata=_h(
        "image tokens a step may encode (vLLM's encoder budget: a chunk reaching an image beyond it waits a step); "
        "default max_num_batched_tokens (at least one image)"))
    encoder_cache_tokens: int | None = field(default=None, metadata=_h(
        "image tokens of encoder outputs kept for reuse by content (LRU; those in use always kept); default 4x the "
        "encoder budget"))
    distributed_executor_backend: str = field(default="mp", metadata=_h(
        "mp (worker processes on this machine) | ray (Ray actors, on any node of a Ray cluster; pip install "
        "pagedserve[ray]) | external_launcher (every rank started by torchrun; env:// rendezvous)"))

    engine_process: bool = field(default=False, metadata=_h(
        "run the engine core (scheduler, runner, KV pool) in a process of its own, behind the core's protocol "
        "(msgpack step outputs; engine/core_proc.py), so detokenization, stop strings, metrics and HTTP do not "
        "share its interpreter; serve's default (--no-engine-process: one process), LLM's only when asked. A "
        "vision-language model's core stays in process (its images do not cross the protocol)"))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "must be a positive integer")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", "must be a positive integer")
        if self.tensor_parallel_size > 1 and self.quantization not in ("none", "auto"):
            bad("tensor_parallel_size", f"> 1 needs quantization none (packed {self.quantization} weights are not "
                                        "sharded)")
        for name in ("warm_gemm_shapes", "engine_process"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False")
        if self.packed_rows is not None and (not isinstance(self.packed_rows, int) or isinstance(self.packed_rows, bool)
                                             or self.packed_rows < 1):
            bad("packed_rows", "must be a positive integer or None")
        if self.batch_invariant:
            if self.packed_rows is not None:
                bad("packed_rows", "cannot be pinned with batch_invariant (every row is packed there)")
            if self.enable_lora:
                bad("enable_lora", "cannot be combined with batch_invariant (adapters' rows take other kernels)")
            if self.quantization not in ("auto", "gguf"):
                bad("quantization", "must be auto or gguf with batch_invariant (its rows are the packed kernels')")
            if self.device != "cpu" or self.tensor_parallel_size > 1:
                bad("batch_invariant", "runs on one CPU rank (the packed kernels); device and tensor_parallel_size "
                                       "must be cpu and 1")
        from pagedserve.engine.multimodal import image_limit
        image_limit(self.limit_mm_per_prompt)
        for name in ("num_kv_blocks", "max_model_len", "num_threads", "encoder_budget_tokens", "encoder_cache_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                bad(name, "must be a positive integer or None")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            bad("num_kv_blocks", "must be at least 2 (block 0 is reserved)")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            bad("max_waiting_requests", "must be non-negative")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        choices = {"dtype": ("auto", "float32", "bfloat16", "float16"),
                   "kv_cache_dtype": ("auto", "float32", "bfloat16", "int8"), "device": ("cpu", "cuda"),
                   "attention_backend": ("auto", "native", "triton", "torch"),
                   "quantization": ("auto", "none", "gguf", "int8"), "pooling": (None, "last", "mean", "cls", "max"),
                   "preemption_mode": ("recompute", "swap"), "kv_allocation": ("paged", "contiguous"),
                   "scheduling_policy": ("continuous", "static"),
                   "distributed_executor_backend": ("mp", "ray", "external_launcher")}
        for name, ok in choices.items():
            if getattr(self, name) not in ok:
                bad(name, f"must be one of {ok}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool) \
                or not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "must be a number in (0, 1]")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            bad("swap_space", "must be a non-negative number of GiB")
        spec = SpeculativeConfig.parse(self.speculative_config)
        if spec is not None and self.tensor_parallel_size > 1:
            bad("speculative_config", "is not supported with tensor_parallel_size > 1")
        if spec is not None and self.scheduling_policy == "static":
            bad("speculative_config", "is not supported with scheduling_policy static")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "must be a positive integer")
        if self.max_lora_rank > 512:
            bad("max_lora_rank", "must be at most 512")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or isinstance(self.max_cpu_loras, bool)
                                               or self.max_cpu_loras < self.max_loras):
            bad("max_cpu_loras", f"must be an integer >= max_loras ({self.max_loras}) or None")
        from pagedserve.lora_request import parse_lora_modules
        modules = parse_lora_modules(self.lora_modules)
        if modules and not self.enable_lora:
            bad("lora_modules", "needs enable_lora")
        if self.enable_lora and self.tensor_parallel_size > 1:
            bad("enable_lora", "is not supported with tensor_parallel_size > 1")
        if self.enable_lora and self.scheduling_policy == "static":
            bad("enable_lora", "is not supported with scheduling_policy static")
        if self.max_cpu_loras is not None and len(modules) > self.max_cpu_loras:
            bad("max_cpu_loras", f"is less than the {len(modules)} adapters of lora_modules")
        from pagedserve.core.traffic import TrafficClasses
        if TrafficClasses.parse(self.traffic_classes) is not None and self.scheduling_policy == "static":
            bad("traffic_classes", "are not supported with scheduling_policy static")
        if self.strict_slo and TrafficClasses.parse(self.traffic_classes) is None:
            bad("strict_slo", "needs traffic_classes (it checks their itl_p99_ms against the host's floor)")

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in fields(cls)}

    @classmethod
    def field_specs(cls):
        """(name, type, default, help) of every field: what the CLI builds its flags from."""
        for f in fields(cls):
            default = None if f.default is MISSING else f.default
            yield f.name, f.type, default, f.metadata.get("help", "")

    @classmethod
    def add_cli_args(cls, ap: argparse.ArgumentParser, positional_model: bool = False) -> None:
        """One flag per field (vLLM's name for this): --name-with-dashes, typed by the field's annotation,
        booleans as --x / --no-x; `model` positional where the subcommand takes one."""
        g = ap.add_argument_group("engine")
        for name, tp, default, help_ in cls.field_specs():
            flag = "--" + name.replace("_", "-")
            if name == "model" and positional_model:
                ap.add_argument("model", nargs="?", default=None, help=help_)
                continue
            base = _base_type(tp)
            if base is bool:
                g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
            elif typing.get_origin(base) is list:
                g.add_argument(flag, nargs="+", default=default, help=help_)
            else:
                g.add_argument(flag, type=base, default=default, help=f"{help_} (default: {default})")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = [n for n, *_ in cls.field_specs()]
        return cls(**{n: getattr(ns, n) for n in names if hasattr(ns, n)})


def _base_type(tp):
    if isinstance(tp, str):   # postponed annotations
        tp = eval(tp, {"int": int, "float": float, "str": str, "bool": bool, "dict": dict, "list": list,
                       "None": type(None)})
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} must be a size like 2GiB or 512MiB, got {value!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n
