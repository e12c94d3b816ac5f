# Quick start: `make demo` (the main job on the embedded default) and `make test`.
# Every target creates or updates the project virtualenv (.venv) itself; when nothing changed this is a no-op.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Cached JIT builds (DeepSpeed's shared-memory comm op) live inside the venv: per machine, never shared.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
PYTEST_ARGS ?=

.PHONY: venv test test-fast demo data flops bench reproduce clean help

help:
	@echo "make demo   - build the demo corpus, train tiny Dense/DEMix models on local CPU ranks, report"
	@echo "make test   - run the test suite (unit, multi-rank gloo, parity)"
	@echo "make data   - build the offline demo corpus and its tokenised, indexed form"
	@echo "make flops  - print the paper's Table 2/9 FLOPs and parameter accounting"
	@echo "make bench  - run the CPU benchmarks"
	@echo "make reproduce - every architecture with seeds on the demo corpus, each paper claim with a verdict (long; resumable)"
	@echo "make modular - add a novel-domain expert to the demo DEMix model, DEMix-DAPT vs Dense-DAPT, remove an expert (Tables 6/7/13)"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# The pinned torch first: on a machine without CUDA this is the local CPU wheel, never a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

data: $(STAMP)
	$(BIN)/python -m data.build_demo

demo: $(STAMP)
	$(BIN)/python -m benchmarks.demo

flops: $(STAMP)
	$(BIN)/python -m launcher.flops --paper

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

# Not in CI: every architecture with seeds on the demo corpus, claims with verdicts (resumable: rerun after a kill).
reproduce: $(STAMP)
	$(BIN)/python -m data.build_demo --tokenizers sentencepiece
	$(BIN)/python -m benchmarks.reproduce --record benchmarks/results/reproduce

clean:
	rm -rf runs artifacts .pytest_cache

.PHONY: modular
# Needs the demo checkpoints (runs/demo/{demix,dense}/model, from `make demo`); writes runs/modular/.
modular: $(STAMP)
	$(BIN)/python -m launcher.modular.experts demo
