"""The door in values (engine/info.py): the frontend reads a frozen EngineInfo and CoreStats, never the
core's objects; the server's modules never reach behind LLMEngine to `.core`."""
import dataclasses
import pathlib
import re

import pytest

from pagedserve.sampling_params import SamplingParams


def test_engine_info_is_frozen_and_says_what_the_core_is(llm):
    eng = llm.engine
    info, core = eng.info, eng.core
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1
    assert not hasattr(eng, "scheduler") and not hasattr(eng, "kv")     # no __getattr__ into the core
    assert (info.max_model_len, info.vocab_size, info.eos_token_ids, info.block_size) == \
        (core.max_model_len, core.model_config.vocab_size, core.eos_token_ids, core.args.block_size)
    assert (info.max_num_seqs, info.max_num_batched_tokens, info.num_kv_blocks) == \
        (core.args.max_num_seqs, core.args.max_num_batched_tokens, core.kv.pool.num_usable_blocks)
    assert info.generates and info.traffic_classes is None and info.speculative is None and not info.enable_lora
    with pytest.raises(ValueError, match="token_ids: token id .* outside the vocabulary"):
        info.check_token_ids("token_ids", [0, info.vocab_size])


def test_stats_are_values_taken_when_asked(llm):
    eng = llm.engine
    before = eng.stats(shared=True)
    llm.generate(["Hello, my name is"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    after = eng.stats()
    assert after.counters.steps > before.counters.steps and after.counters.generation_tokens == \
        before.counters.generation_tokens + 3
    after.counters.finished["length"] = -1          # a copy: the core's totals are untouched
    assert eng.stats().counters.finished["length"] != -1
    assert before.num_shared_savings == 0 and after.num_shared_savings is None
    assert after.num_running == after.num_waiting == 0 and after.step.rows          # the last step's rows
    assert after.num_free_blocks + after.num_used_blocks == eng.info.num_kv_blocks


def test_the_server_modules_never_reach_the_core():
    root = pathlib.Path(__file__).parents[2] / "pagedserve" / "entrypoints"
    offenders = [f"{p.name}:{i}" for p in root.glob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"\.core\.|\.core\b(?!\.)", line) and "pagedserve.core" not in line]
    assert offenders == []
