"""A small multiple-choice task and a small generation task of our own for lm-evaluation-harness,
written to a folder as JSONL data + task YAML (no hub access). Shared by the test and bench/lm_eval_bench.py."""
from __future__ import annotations

import json
import os

MC = [  # (question, choices, index of the answer)
    ("What colour is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("Which animal barks?", ["cat", "cow", "fish", "dog"], 3),
    ("What is 2 + 2?", ["4", "5", "3", "22"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("Which season is the coldest?", ["winter", "summer", "spring", "autumn"], 0),
    ("How many days are in a week?", ["five", "seven", "ten", "twelve"], 1),
    ("What is the opposite of hot?", ["warm", "loud", "cold", "fast"], 2),
    ("Which fruit is yellow and curved?", ["apple", "grape", "cherry", "banana"], 3),
    ("What do you use to write on paper?", ["a pen", "a spoon", "a shoe", "a cup"], 0),
    ("Which is the largest ocean?", ["Arctic", "Pacific", "Indian", "Atlantic"], 1),
    ("What gas do people need to breathe?", ["helium", "neon", "oxygen", "argon"], 2),
    ("How many hours are in a day?", ["12", "48", "60", "24"], 3),
    ("What is the first letter of the English alphabet?", ["A", "Z", "M", "Q"], 0),
    ("Which animal is known as the king of the jungle?", ["mouse", "lion", "sheep", "frog"], 1),
    ("What do plants need from the sun?", ["sound", "rain", "light", "snow"], 2),
    ("Which shape has three sides?", ["square", "circle", "hexagon", "triangle"], 3),
]

GEN = [("Q: What is the capital of Italy?\nA:", "Rome"), ("Q: What is 3 + 4?\nA:", "7"),
       ("Q: What colour is grass?\nA:", "Green"), ("Q: How many legs does a cat have?\nA:", "4")]


def write_tasks(folder: str) -> dict[str, str]:
    """Writes the data and task YAMLs; returns {task name: yaml path}."""
    os.makedirs(folder, exist_ok=True)
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in MC]
    gen = [{"question": q, "answer": a} for q, a in GEN]
    return {"pagedserve_mc": _task(folder, "pagedserve_mc", mc, """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""), "pagedserve_gen": _task(folder, "pagedserve_gen", gen, """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""")}


def _task(folder: str, name: str, docs: list[dict], body: str) -> str:
    """A local JSONL test split and the task YAML that reads it (the task-specific lines in `body`)."""
    data, yaml = os.path.join(folder, f"{name}.jsonl"), os.path.join(folder, f"{name}.yaml")
    with open(data, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(yaml, "w") as f:
        f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                f"test_split: test\n" + body)
    return yaml
