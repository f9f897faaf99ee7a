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
# the suite's tests wait on peers much of the time (one swarm test keeps ~40% of 2 cores busy): three workers
# (pytest-xdist) run three modules at a time and keep the 2 cores ~94% busy (two: ~86%, 18 minutes instead of 16);
# each module stays on one worker, with its shared swarm, the longest first (tests/conftest.py)
WORKERS ?= 3
PYTEST_WORKERS := -n $(WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: venv venv-tpu test test-fast test-scale lint demo bench gpu-check clean

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
	SAHAJBERT_REQUIRE_XLA=1 $(BIN)/python -m pytest $(PYTEST_WORKERS) -ra --durations=20 -m "not scale"

# the unit tier for the edit loop: no swarm of processes, no TPU environment (under 3 minutes on 2 cores)
test-fast: lint
	$(BIN)/python -m pytest $(PYTEST_WORKERS) -q -m "not slow and not xla and not scale"

# the real-size scenarios (the sahajbert preset and shaped links of benchmarks/netswarm.py: root, minutes each), one
# at a time: network namespaces are machine-wide
test-scale: venv
	$(BIN)/python -m pytest -ra --durations=20 -m scale

# the demo's flags can be added for a run of another size: make demo DEMO_FLAGS="--max_steps 3"
demo: venv
	$(BIN)/python run_local_swarm.py $(DEMO_FLAGS)

# on a CUDA machine, fresh: .venv with PyPI's torch (a CUDA build), then the checks only a GPU runs, in one table
# (benchmarks/gpu_check.py; about 10 minutes)
gpu-check:
	$(MAKE) venv TORCH="torch>=2.4,<2.15"
	$(BIN)/python benchmarks/gpu_check.py

bench: venv
	$(BIN)/python benchmarks/bench_data.py
	$(BIN)/python benchmarks/bench_swarm.py

clean:
	rm -rf $(VENV) $(TPU_VENV) outputs .pytest_cache .ruff_cache
