"""Shared fixtures. Loading a model costs seconds, so the default model, its HF reference and one
engine are session-scoped and shared by every test that can share them."""
from __future__ import annotations

import os

import pytest
import torch

# under pytest-xdist (`make test` runs two workers) each worker takes its share of the cores: two
# workers with two OpenMP threads each on two cores spin against each other
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
if not torch.cuda.is_available():
    # the Triton attention kernels run in Triton's interpreter here; the mode is fixed when triton is first
    # imported, and transformers' modeling modules import it, so before any test module loads
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _first_trig_calls_here() -> None:
    """torch 2.13's threaded float32 cos was measured up to 1.5e-4 off on the second thread's half of
    the rows in the first call of a process (about 1 pytest process in 4; a later call is right). Our
    RoPE table no longer uses torch's cos (model/llama.py), but the HF reference computes its table
    with it on every forward: the first calls happen here, on values no test reads."""
    x = torch.arange(300, dtype=torch.float32)[:, None] * torch.rand(64)
    for t in (x.double(), x, x.double(), x):
        t.cos(), t.sin()


_first_trig_calls_here()


@pytest.fixture(scope="session")
def default_source():
    from pagedserve.model.loader import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_model(default_source):
    from pagedserve.model.loader import load_model
    return load_model(default_source)


@pytest.fixture(scope="session")
def tokenizer(default_source):
    from pagedserve.tokenizer import load_tokenizer
    return load_tokenizer(default_source)


@pytest.fixture(scope="session")
def converted_default(default_source):
    """transformers' own conversion of the default GGUF's tokenizer (~10 s): the reference the GGUF tokenizer
    tests compare with."""
    from pagedserve.tokenizer import convert_gguf_tokenizer
    return convert_gguf_tokenizer(default_source.path)


@pytest.fixture(scope="session")
def hf_model(default_source):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_source.path),
                                             gguf_file=os.path.basename(default_source.path), dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def llm():
    """One engine for tests that only read outputs (they must leave it idle)."""
    from pagedserve import LLM
    return LLM(num_kv_blocks=1024, block_size=16, dtype="float32")


CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and explain what a prime number is.",
    "Translate 'good morning, my friend' into Spanish and German.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old, in a short paragraph, mentioning the two "
    "families, the balcony scene and how the story ends.",
    "You are reviewing code. A function adds two numbers but is called with strings, so it concatenates "
    "them instead. Describe the bug, propose a fix in Python with type checks, and explain how a unit "
    "test would catch it. Keep the answer under one hundred words please, and use a numbered list.",
    "How many legs does a spider have?",
    "Give me a short motivational quote.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci and describe it briefly.",
]


@pytest.fixture(scope="session")
def sharp_llama(tmp_path_factory) -> str:
    """A random Llama of 512 words that transformers writes, sharp enough that its greedy outputs vary (at the
    default sharpness a random model settles on one token, where an equality check tells little): for tests of
    the engine's bookkeeping (preemption, swap, drafts), which do not need the default model's outputs."""
    from tests.model.families import save_family, tiny_tokenizer
    d, tok = tmp_path_factory.mktemp("sharp_llama"), tiny_tokenizer(512)
    save_family("llama", d, len(tok), tok, sharpen=8.0)
    return str(d)


@pytest.fixture(scope="session")
def chat_prompt_ids(tokenizer):
    from pagedserve.tokenizer import apply_chat_template
    return [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
