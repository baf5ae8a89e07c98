# make test: installs what is missing (venv, packages) and runs the whole suite. .ci/run calls it.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test run bench bench-quick gpu-bench clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3.11 or run make PYTHON=python3"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned: this version's CPU wheel is on local disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[workers,test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

run: $(STAMP)
	@echo "make run (a whole local RLHF job) arrives with issue 3 (trainer + generator pods)."
	@echo "Meanwhile: make bench-quick runs one long-tailed rollout batch with adaptive TP."
	@exit 2

bench: $(STAMP)
	$(PY) bench/tail.py

bench-quick: $(STAMP)
	$(PY) bench/tail.py --quick

gpu-bench: $(STAMP)
	$(PY) bench/gpu_decode.py

clean:
	rm -rf $(VENV) .pytest_cache
