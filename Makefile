# farmflow developer entry points. Each target creates .venv when missing and installs
# what it needs first: torch==2.13.0 with pip (the local CPU wheel pip's config points at), then
# everything else, pinned by constraints.txt, with uv (~4 s instead of pip's ~45 s).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.farmflow-installed

export PREFECT_HOME ?= $(CURDIR)/.farmflow/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt uv
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: install  ## the offline synthetic farm end to end (a few minutes on 2 CPU cores)
	mkdir -p "$(PREFECT_HOME)"
	$(VENV)/bin/farmflow demo

test: install  ## the whole suite, slow end-to-end tests included
	$(PY) -m pytest -q

bench: install  ## performance benchmarks; results in bench/results/
	$(PY) -m bench.sampling
	$(PY) -m bench.annotators  # creates .farmflow/bench/alpaca-eval-venv (pinned alpaca_eval) for the peer once
	$(PY) -m bench.store
	$(PY) -m bench.training  # creates .farmflow/bench/trl-venv (pinned TRL on top of .venv's packages) for the peer once
	$(PY) -m bench.gpu  # ~1B Llama on a CUDA GPU (a few minutes); prints a message and skips without one

clean:  ## remove the local store and Prefect state (not the venv)
	rm -rf .farmflow
