# Quick start: `make demo` (the main job on the embedded default) and `make test`.
# Every target creates or updates the project virtualenv (.venv) itself; when nothing changed this is a no-op.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Cached JIT builds (DeepSpeed's shared-memory comm op) live inside the venv: per machine, never shared. The same
# default as launcher/rundir.py `default_extensions_dir` (which launch and train apply when it is unset); a value set
# in the environment is kept.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
PYTEST_ARGS ?=

.PHONY: venv wheels gpu-wheels test test-long lint format test-fast demo data flops bench reproduce clean help

help:
	@echo "make venv   - create .venv with everything installed (the other targets do this first when needed)"
	@echo "make demo   - build the demo corpus, train tiny Dense/DEMix models on local CPU ranks, report"
	@echo "make test   - run the test suite (unit, multi-rank gloo, parity): everything but the tests marked long"
	@echo "make test-long - the long end-to-end runs of the real cluster programs (launchers, SLURM, sshd+pdsh, signals"
	@echo "              and faults on launched jobs, the simulated GPU node); CI runs it after make test"
	@echo "make lint   - ruff + mypy: formatting check, lint, types (CI runs it before the tests); make format rewrites"
	@echo "make gpu-wheels - gpu-wheels/: only what a stock GPU image lacks (<= 10 MiB; PY=3.12, NODE=freeze.txt); on the"
	@echo "              node: bash scripts/gpu_checks.sh --out DIR (its own Python, no venv, no network): docs/gpu.md"
	@echo "make wheels - wheelhouse/ for a full offline venv (PY=3.12); there: make venv OFFLINE=1 SYSTEM_TORCH=1"
	@echo "make data   - build the offline demo corpus and its tokenised, indexed form"
	@echo "make flops  - print the paper's Table 2/9 FLOPs and parameter accounting"
	@echo "make bench  - run the CPU benchmarks (re-timed every run); report in runs/bench/ (= python -m benchmarks.run)"
	@echo "              make bench RECORD=1: write the tracked copy in benchmarks/results/ (python -m benchmarks.run --record)"
	@echo "              make bench BENCH_DATA=PATH [BENCH_TOKENIZER=gpt2|sentencepiece]: on a prepared corpus (--data PATH --tokenizer NAME)"
	@echo "make reproduce - every architecture with seeds on the demo corpus, each paper claim with a verdict (long; resumable)"
	@echo "make modular - add a novel-domain expert to the demo DEMix model, DEMix-DAPT vs Dense-DAPT, remove an expert (Tables 6/7/13)"

venv: $(STAMP)

# Online (default): the pinned torch, then the project with every extra, from the package index.
# Offline GPU node: `make venv OFFLINE=1 SYSTEM_TORCH=1` builds .venv on the node's own torch (a venv that sees the
# system site-packages; no torch install) from wheelhouse/ (`make wheels` on a connected machine), with no network.
TORCH_PIN := torch==2.13.0
OFFLINE ?= 0
SYSTEM_TORCH ?= 0
WHEELHOUSE ?= wheelhouse
EXTRAS_WHEELS := $(wildcard $(WHEELHOUSE)/extras/*.whl)
PIP_SOURCE := $(if $(filter 1,$(OFFLINE)),--no-index --find-links $(WHEELHOUSE)/core $(if $(EXTRAS_WHEELS),--find-links $(WHEELHOUSE)/extras),)
NODE_EXTRAS := dev,tracking,harness
ALL_EXTRAS := $(NODE_EXTRAS),lint
# Offline without wheelhouse/extras: no wandb, no lm-eval (their tests skip, saying so). No linter on a GPU node.
PROJECT_EXTRAS := $(if $(filter 1,$(OFFLINE)),$(if $(EXTRAS_WHEELS),$(NODE_EXTRAS),dev),$(ALL_EXTRAS))

$(STAMP): pyproject.toml
	@if [ "$(SYSTEM_TORCH)" = 1 ]; then \
	  $(PYTHON) -c 'import torch' 2>/dev/null || { echo "SYSTEM_TORCH=1: $(PYTHON) has no torch (load the site's module, or PYTHON=/path/to/python)" >&2; exit 2; }; \
	  $(PYTHON) scripts/torch_range.py || exit 2; \
	  test ! -e $(VENV) || grep -q "include-system-site-packages = true" $(VENV)/pyvenv.cfg || { echo "SYSTEM_TORCH=1: $(VENV) exists without the system torch: remove it first" >&2; exit 2; }; \
	  test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV); \
	  $(PYTHON) scripts/outer_site.py $(VENV) || exit 2; \
	else \
	  test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
	fi
	@if [ "$(OFFLINE)" = 1 ]; then \
	  test -d $(WHEELHOUSE)/core || { echo "OFFLINE=1: no $(WHEELHOUSE)/core: run 'make wheels PY=<the node's python>' on a machine with network and copy it here" >&2; exit 2; }; \
	else \
	  $(BIN)/python -m pip install -q --upgrade pip; \
	fi
	@# Online without SYSTEM_TORCH: the pinned torch first (on a machine without CUDA the local CPU wheel, never a multi-GB CUDA build).
	@if [ "$(SYSTEM_TORCH)" != 1 ] && [ "$(OFFLINE)" != 1 ]; then $(BIN)/python -m pip install -q "$(TORCH_PIN)"; fi
	@# Offline: the requirements from wheelhouse/, and the repository on the path (.pth) as an editable install puts
	@# it, with no build of the project (its setuptools could conflict with the node's torch).
	@if [ "$(OFFLINE)" = 1 ]; then \
	  $(BIN)/python scripts/project_requirements.py $(PROJECT_EXTRAS) > $(VENV)/requirements.txt && \
	  $(BIN)/python -m pip install -q $(PIP_SOURCE) -r $(VENV)/requirements.txt && \
	  $(BIN)/python -c 'import site, sys; open(site.getsitepackages()[0] + "/demix-repo.pth", "w").write(sys.argv[1] + "\n")' "$(CURDIR)"; \
	else \
	  $(BIN)/python -m pip install -q -e ".[$(PROJECT_EXTRAS)]"; \
	fi
	@touch $@

# A wheelhouse for an offline node: every dependency but torch, for Python $(PY) (default: this machine's), at the
# versions .venv was tested with: wheelhouse/core (training, evaluation, tests) and wheelhouse/extras (wandb, lm-eval).
PY ?=
wheels: $(STAMP)
	$(BIN)/python scripts/wheelhouse.py $(if $(PY),--python-version $(PY),) $(if $(ARCH),--arch $(ARCH),) $(if $(NODE),--node-has $(NODE),)

# The few wheels a stock GPU image lacks (deepspeed, megatron-core, pydantic, ...), for its own Python (default 3.12),
# never shadowing what it has: carried with the repository to an offline node (scripts/gpu_wheels.py, docs/gpu.md).
gpu-wheels: $(STAMP)
	$(BIN)/python scripts/gpu_wheels.py --python-version $(or $(PY),3.12) $(if $(ARCH),--arch $(ARCH),) $(if $(NODE),--node $(NODE),)

# `long`: end-to-end runs of the real programs of a cluster and a GPU node (pyproject.toml says which); CI runs both.
test: $(STAMP)
	$(BIN)/python -m pytest -m "not long" $(PYTEST_ARGS)

test-long: $(STAMP)
	$(BIN)/python -m pytest -m long $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff format --check . || { echo "make lint: files above need formatting: run 'make format'" >&2; exit 1; }
	$(BIN)/ruff check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not long" $(PYTEST_ARGS)

data: $(STAMP)
	$(BIN)/python -m data.build_demo

demo: $(STAMP)
	$(BIN)/python -m launcher.demo

flops: $(STAMP)
	$(BIN)/python -m launcher.flops --paper

# Outputs to runs/bench/ (ignored by git); RECORD=1 writes the tracked benchmarks/results/ copy. BENCH_DATA=PATH [BENCH_TOKENIZER=NAME]:
# every point on that prepared corpus (PATH/<tokenizer>/manifest.json) instead of the demo corpus.
RECORD ?= 0
BENCH_DATA ?=
BENCH_TOKENIZER ?=
bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(if $(filter 1,$(RECORD)),--record) $(if $(BENCH_DATA),--data "$(BENCH_DATA)") $(if $(BENCH_TOKENIZER),--tokenizer $(BENCH_TOKENIZER))

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
