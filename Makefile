# The two commands a new user runs: `make train` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: train test lint bench clean

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
# Two workers, a test file each at a time (module fixtures run once): most tests start one process or wait on one,
# so a serial run kept half of a 2-core machine idle (measured: 104% CPU, 25 min; with -n 2, 158% and 21 min).
# --no-loadscope-reorder keeps conftest's longest-files-first order (xdist would sort files by test count).
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 tests $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check scaletrain tests benchmarks
	$(BIN)/ruff format --check scaletrain tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs
