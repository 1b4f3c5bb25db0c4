# farmflow developer entry points. Each target creates .venv when missing and installs
# what it needs first, with uv: torch==2.13.0 (the local CPU wheel in the folder pip's config
# names; uv does not read pip's config, so it is passed on), then everything else, pinned by
# constraints.txt (~12 s in all from an empty venv, where pip took ~60 s).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.farmflow-installed
# Where pip finds local wheels (the CPU torch wheel): $PIP_FIND_LINKS or pip's config; may be empty.
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))

# Let Python cache compiled modules (.pyc, in .venv and src/, git-ignored) even where the
# environment turns that off: otherwise every process (the demo, Prefect's server, each test
# subprocess) compiles torch, transformers and Prefect from source again, ~10 s each.
unexport PYTHONDONTWRITEBYTECODE

export PREFECT_HOME ?= $(CURDIR)/.farmflow/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: install demo lint test bench chaos clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt uv
	$(VENV)/bin/uv pip install -q --python $(PY) $(foreach d,$(FIND_LINKS),--find-links $(d)) torch==2.13.0
	$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: install  ## the offline synthetic farm end to end (about 20 min on 2 CPU cores into an empty store; seconds cached)
	mkdir -p "$(PREFECT_HOME)"
	$(VENV)/bin/farmflow demo

lint: install  ## ruff: lint rules and formatting (configured in pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install  ## the whole suite, slow end-to-end tests included
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

bench: install  ## performance benchmarks; results in bench/results/
	$(PY) -m bench.sampling  # SmolLM2-135M-Instruct from the model cache (farmflow models get smollm2-135m-instruct)
	$(PY) -m bench.annotators  # creates .farmflow/bench/alpaca-eval-venv (pinned alpaca_eval) for the peer once
	$(PY) -m bench.features  # a frozen reward model's features on SmolLM2-135M-Instruct: bfloat16 autocast vs float32
	$(PY) -m bench.scoring  # best-of-n candidates scored by a SmolLM2-135M-Instruct reward model: each prompt once (packed) vs a padded row each
	$(PY) -m bench.mixed_precision  # fine-tuning a reward model on SmolLM2-135M-Instruct: bfloat16 weights (mixed) vs float32, top 4 blocks vs all, packed pairs vs padded
	$(PY) -m bench.judge  # the hf judge on SmolLM2-135M-Instruct from the model cache: guidance read once vs whole
	$(PY) -m bench.serve_judge  # the same judge in process vs behind transformers serve on loopback
	$(PY) -m bench.store
	$(PY) -m bench.cli  # fixed cost of a fully cached `farmflow run`, with and without a running Prefect server
	$(PY) -m bench.lc  # a synthetic-tiny-sized leaderboard's LC fits: cross-validation in worker processes vs in this one
	$(PY) -m bench.training  # creates .farmflow/bench/trl-venv (pinned TRL on top of .venv's packages) for the peer once
	$(PY) -m bench.gpu  # ~1B Llama on a CUDA GPU (a few minutes); prints a message and skips without one
	$(PY) -m bench.report  # BENCHMARKS.md from bench/results/*.json

chaos: install  ## faults against real components on loopback (~30 min on 2 busy cores); writes docs/reliability.md
	nice -n 10 $(PY) -m bench.chaos

clean:  ## remove the local store and Prefect state (not the venv)
	rm -rf .farmflow
