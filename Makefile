# `make demo` and `make test` are the README's Quickstart; both set up .venv when needed.
# Two test tiers: `make test` (everyday, <= 10 min: unit tests and one real 2-rank run) and
# `make check` (everything: every multi-rank, SLURM, bench-smoke and sampled fault test; what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed

# DeepSpeed JIT-compiles its CPU ops into TORCH_EXTENSIONS_DIR. One cache per checkout: checkouts
# sharing ~/.cache/torch_extensions keep invalidating each other's build (a ~2 min rebuild each time).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

# Tests run on WORKERS processes (pytest-xdist): the CPU count, at most 4 (each real run is 2-4
# ranks). A module that launches ranks stays on one worker (tests/conftest.py's scheduler).
# WORKERS=0: serial.
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadscope)

.PHONY: setup gpu-setup demo test check test-gpu faults bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# Only when there is no torch: a plain `pip install torch` would pull several GB of CUDA wheels.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	# DeepSpeed ships as an sdist whose build imports torch: build it against the torch above.
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	# DeepSpeed's CPU ops, compiled once here rather than inside the first run (or test).
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) scripts/build_ops.py
	touch $(STAMP)

# On a GPU machine, after installing torch for its CUDA (see docs/CLUSTERS.md "GPU setup"): `make setup` then this,
# which fails when FusedAdam (needs nvcc) or CPU Adam can't be built. Runs work without them (torch_adam).
gpu-setup: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) scripts/build_ops.py --strict

demo: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH deepspeed --log_level warning --num_gpus 2 --module finetune --save_checkpoint --eval_steps 25 --output_dir output/demo

# Unit tests (fakes for the filesystem and the engine where the behaviour is ours, real DeepSpeed
# in one process where it is DeepSpeed's) and tests/test_end_to_end.py: one 2-rank run and its resume.
test: setup
	$(PY) -m pytest -ra --durations=10 $(XDIST) -m "not distributed and not e2e and not faults and not gpu" tests

check: setup
	$(PY) -m pytest -ra --durations=25 $(XDIST) tests

# The GPU suite (tests/gpu): one CUDA device, NCCL. `make check` runs it too, skipped without a GPU.
test-gpu: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -ra -m gpu tests/gpu

# The fault sweep's long form (tests/faults, and tests/slurm's repeated preemption attempts): every
# fault site x rank x kind, 50 kill -9 trials of each kind, storms, disk full; over 1 h on a 2-core
# machine (docs/RELIABILITY.md has the figures). Prints a summary table (cases, failures, max time
# to exit) and writes output/faults/summary.json. `make check` runs its sample. Then the history
# explorer's long form: 5,000 new histories, and the slow form's real runs (`make test` runs 300 fixed
# histories, `make check` one real one).
faults: setup
	FINETUNE_FAULTS_LONG=1 FINETUNE_FAULTS_SUMMARY=output/faults/summary.json \
		PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -ra -m faults tests/faults tests/slurm
	FINETUNE_FAULTS_LONG=1 FINETUNE_HISTORIES=5000 FINETUNE_HISTORIES_FRESH=1 $(PY) -m pytest -ra -s tests/history

# The benchmark suite (P1…P10, ~30 min on 2 cores): writes bench/results/latest.json and rewrites the
# tables in docs/BENCHMARKS.md and README.md. Each script under bench/<subject>/ also runs on its own
# (docs/BENCHMARKS.md).
bench: setup
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) bench/run_all.py

clean:
	rm -rf output bench/results
