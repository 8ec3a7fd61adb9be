"""lm-evaluation-harness, unmodified, against `pagedserve serve` (over HTTP, in a thread here): a
multiple-choice task scored with `local-completions` (echo + prompt logprobs, several prompts per
request, the remote tokenizer endpoints) agrees with lm-eval's own `hf` backend on the transformers
model loaded from the same GGUF in fp32; a generation task runs through `local-chat-completions`."""
from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")      # the task data is a local JSONL: nothing to download
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from tests.entrypoints.helpers import serve_in_thread  # noqa: E402
from tests.entrypoints.lm_eval_tasks import GEN, MC, write_tasks  # noqa: E402


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    from lm_eval.tasks import TaskManager
    folder = str(tmp_path_factory.mktemp("lm_eval_tasks"))
    write_tasks(folder)
    # only our two tasks indexed: indexing lm-eval's thousands of built-in task files took 13 s here
    return TaskManager(include_path=folder, include_defaults=False)


@pytest.fixture(scope="module")
def served():
    from pagedserve import EngineArgs, LLMEngine
    from pagedserve.entrypoints.server import build_app
    engine = LLMEngine(EngineArgs(num_kv_blocks=512, max_num_seqs=16, dtype="float32"))
    with serve_in_thread(build_app(engine, served_model_name="smollm2")) as base:
        yield base, engine


def _per_choice(result, task: str) -> list[list[float]]:
    samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def test_multiple_choice_matches_the_hf_backend(served, tasks, hf_model, tokenizer):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    base, engine = served
    ours = simple_evaluate(model="local-completions", tasks=["pagedserve_mc"], task_manager=tasks, log_samples=True,
                           model_args={"base_url": f"{base}/v1/completions", "model": "smollm2",
                                       "tokenizer_backend": "remote", "batch_size": 4, "max_retries": 1})
    ref = simple_evaluate(model=HFLM(pretrained=hf_model, tokenizer=tokenizer.transformers(), batch_size=4),
                          tasks=["pagedserve_mc"],
                          task_manager=tasks, log_samples=True)
    a, b = _per_choice(ours, "pagedserve_mc"), _per_choice(ref, "pagedserve_mc")
    assert len(a) == len(MC) and all(len(x) == 4 for x in a)
    worst = max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
    print(f"\nlm-eval loglikelihoods: largest difference ours vs hf = {worst:.2e}; acc ours "
          f"{ours['results']['pagedserve_mc']['acc,none']:.3f} hf {ref['results']['pagedserve_mc']['acc,none']:.3f}")
    assert worst < 1e-3
    for m in ("acc,none", "acc_norm,none"):
        assert ours["results"]["pagedserve_mc"][m] == ref["results"]["pagedserve_mc"][m]
    assert not engine.has_unfinished_requests()


def test_generation_through_local_chat_completions(served, tasks):
    from lm_eval import simple_evaluate
    base, engine = served
    res = simple_evaluate(model="local-chat-completions", tasks=["pagedserve_gen"], task_manager=tasks,
                          apply_chat_template=True, log_samples=True,
                          model_args={"base_url": f"{base}/v1/chat/completions", "model": "smollm2",
                                      "max_retries": 1})
    samples = res["samples"]["pagedserve_gen"]
    assert len(samples) == len(GEN) and all(isinstance(s["resps"][0][0], str) for s in samples)
    assert any(s["resps"][0][0].strip() for s in samples)
    assert 0.0 <= res["results"]["pagedserve_gen"]["exact_match,none"] <= 1.0
