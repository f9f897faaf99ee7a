# Both Quickstart commands bootstrap .venv from the requirements on a fresh machine (Python >= 3.10).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch_xla 2.9 needs torch 2.9 exactly, so the TPU path has its own environment (about 7 GB; cached between runs)
TPU_VENV := .venv-tpu
# The CPU build of this torch release is what the tests run with; pip takes it from a local wheel where one is
# provided (as on our CI machines) and from PyPI elsewhere. Override for a GPU machine: make demo TORCH=torch
TORCH ?= torch==2.13.0
export HF_DATASETS_OFFLINE ?= 1
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline

.PHONY: venv venv-tpu test test-fast lint demo bench clean

# the package installs editable (pip install -e .): scripts, tests and benchmarks import `sahajbert` from anywhere
$(BIN)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10) and "Python >= 3.10 is required")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

venv: $(BIN)/.installed

$(TPU_VENV)/bin/.installed: requirements.txt requirements-tpu.txt pyproject.toml
	test -x $(TPU_VENV)/bin/python || $(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q -r requirements-tpu.txt
	$(TPU_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

venv-tpu: $(TPU_VENV)/bin/.installed

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the whole suite, what CI runs: the XLA tests (tests/test_xla.py) run the TPU path on four CPU XLA devices from
# $(TPU_VENV), so here they must run. The two environments build side by side (on 2 cores from a fresh clone: 143 s,
# one after the other 267 s)
test:
	$(MAKE) -j2 venv venv-tpu
	$(MAKE) lint
	SAHAJBERT_REQUIRE_XLA=1 $(BIN)/python -m pytest -ra --durations=15

# the unit tier for the edit loop: no swarm of processes, no TPU environment (a few minutes on 2 cores)
test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow and not xla"

demo: venv
	$(BIN)/python run_local_swarm.py

bench: venv
	$(BIN)/python benchmarks/bench_data.py
	$(BIN)/python benchmarks/bench_swarm.py

clean:
	rm -rf $(VENV) $(TPU_VENV) outputs .pytest_cache .ruff_cache
