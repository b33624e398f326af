# The two commands a new user runs: `make train` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test test-quick preflight lint bench clean compat compat-run gpu-wheels rehearse

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, so nothing else can pull an unpinned (CUDA) build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/scaletrain train --config configs/default.toml --metrics.sample_prompt "def " --metrics.report true $(ARGS)

# Lint first: it takes a second and a style error should not wait 15 minutes of tests to show.
# Three workers, a test file each at a time (module fixtures run once): most tests start one process or wait on one
# (a hang timeout, a killed node, a requeue), so fewer workers kept the 2 cores idle: serial 104% CPU and 25 min;
# -n 2 158% and 21 min, then 100% and 25 min once the cluster stage (mostly waiting) came in. From a clean clone
# with the Slurm, streaming and family tests added: -n 3 25m20s (pytest 24m08s; the files sum to 4282 s); -n 4
# 25m13s (23m53s) at load 21 with a timing flake, so three.
# --no-loadscope-reorder keeps conftest's longest-files-first order (xdist would sort files by test count).
# preflight: the system tools the tests call (a browser, iproute2, ...) installed as root with apt, or named in one
# line with their install command before any test starts; it also prints how long the suite takes here.
test: lint preflight
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=30 tests $(ARGS)

# The edit-test loop (a few minutes): the unit tests and one end-to-end run of the CLI. `make test` is what CI runs.
QUICK := tests/unit tests/e2e/test_train_cli.py::test_single_process_run_writes_the_run_directory_contract
test-quick: lint
	$(BIN)/python -m pytest -q -n 2 --durations=5 $(QUICK) $(ARGS)

preflight: $(STAMP)
	$(BIN)/python -m tests.preflight

lint: $(STAMP)
	$(BIN)/ruff check scaletrain tests benchmarks
	$(BIN)/ruff format --check scaletrain tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

# A launch rehearsed on NODES simulated nodes before an allocation is spent on it (root and iproute2; docs/launching.md,
# Many nodes): CMD runs on every node, with {addr}, {node}, {hostname}, {head} and {is_host} filled in per node.
NODES ?= 2
rehearse: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m tests.cluster.nodes --nodes $(NODES) -- $(CMD)

# What the GPU machine's image lacks, as wheels for benchmarks/gpu_check.sh to install without a network: carry
# .gpu_wheels (git-ignored) with the command (docs/performance.md, GPU check). tomli-w is pure Python (7 KB);
# FP8=1 adds torchao (3.4 MB, abi3: any CPython >= 3.10) for the fp8 phase and fp8 GPU tests.
GPU_WHEELS := tomli-w==1.2.0 $(if $(FP8),torchao==0.18.0)
gpu-wheels:
	mkdir -p .gpu_wheels
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: -d .gpu_wheels $(GPU_WHEELS)

# scaletrain on another torch release, as the GPU machine's image runs it: a throw-away venv outside the checkout
# with that torch (PyPI's CUDA build, several GB, runs on the CPU) and the image's packages but not torchao nor
# tomli-w (taken from .gpu_wheels), PYTHONPATH=. instead of an install. It runs a subset of the unit tests, a 2-rank
# fsdp run checkpointed then resumed, and the GPU check's CPU dry run. SCALETRAIN_ANY_TORCH=1: a release outside
# scaletrain.TORCH_RANGE is tried, not refused. `make compat TORCH=2.11.0 COMPAT_PY=python3.12` matches the image.
TORCH ?= 2.11.0
COMPAT_PY ?= $(PY)
COMPAT_VENV ?= /tmp/scaletrain-torch-$(TORCH)
COMPAT_OUT ?= /tmp/scaletrain-compat-$(TORCH)
COMPAT_PACKAGES := numpy tokenizers safetensors pyarrow rich tensorboard matplotlib fsspec pytest transformers pyyaml
COMPAT_TESTS := tests/unit/test_versions.py tests/unit/test_checkpoint.py tests/unit/test_model.py \
	tests/e2e/test_checkpoint_cli.py
COMPAT_ENV = PATH=$(COMPAT_VENV)/bin:$$PATH PYTHONPATH=$(CURDIR):$(wildcard $(CURDIR)/.gpu_wheels/tomli_w-*.whl) \
	SCALETRAIN_ANY_TORCH=1 PIP_NO_INDEX=1 OMP_NUM_THREADS=1
FSDP_RUN = python -m scaletrain train --config configs/debug.toml --nproc 2 --parallel.data_parallel fsdp \
	--checkpoint.interval 5 --metrics.progress false --run.dir $(COMPAT_OUT)/fsdp
compat:
	test -n "$(wildcard .gpu_wheels/tomli_w-*.whl)" || $(MAKE) gpu-wheels
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PY) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet torch==$(TORCH) $(COMPAT_PACKAGES)
	rm -rf $(COMPAT_OUT) && mkdir -p $(COMPAT_OUT)
	$(MAKE) compat-run
compat-run:
	$(COMPAT_ENV) python -c "import torch, scaletrain; print('torch', torch.__version__, scaletrain.torch_version_problem(torch.__version__) or 'in range')"
	$(COMPAT_ENV) python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)
	$(COMPAT_ENV) $(FSDP_RUN) --training.steps 10
	$(COMPAT_ENV) $(FSDP_RUN) --training.steps 20 --run.accept_changes training.steps
	$(COMPAT_ENV) python -c "import sys; from scaletrain.run.directory import RunDir; e = RunDir.at(sys.argv[1]).read_events(); \
		got = [x['step'] for x in e if x['kind'] == 'checkpoint_loaded']; assert got == [10], got; print('fsdp x2 resumed from', got)" $(COMPAT_OUT)/fsdp
	$(COMPAT_ENV) DEVICE=cpu PRESET=debug OUT=$(COMPAT_OUT)/gpu_check bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) runs
