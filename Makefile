# fp4stack: `make demo` and `make test` work from a fresh clone.
#
# Each target creates the virtual environment if it is missing, installs the pinned torch first
# (so no unpinned requirement can pull a multi-GB CUDA build), then the project. Stamp files in
# the venv make re-runs fast; editing pyproject.toml triggers a re-install.
#
#   make demo               tiny pretraining comparison (bf16 / nvfp4 / lowrank) and tiny RL
#                           comparison (bf16 / fp8 / nvfp4 / nvfp4+tis / quads), CPU, 3 to 4
#                           minutes on 2 cores
#   make test               ruff + pytest (TEST_WORKERS=2 processes)
#   make lint               ruff only
#   make clean              build outputs and caches (keeps the venv)
#   make distclean          clean + remove the venv
#   make VENV=/tmp/v test   use another venv directory
#   make TORCH_INDEX=https://download.pytorch.org/whl/cpu demo   torch's CPU build from its index

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PIP_FLAGS ?= -q
# pytest processes (pytest-xdist; each test file runs whole in one of them)
TEST_WORKERS ?= 2

PY := $(VENV)/bin/python
PIP := $(PY) -m pip $(PIP_FLAGS)
LINT_PATHS := $(wildcard fp4stack tests benchmarks experiments)

.PHONY: demo test lint clean distclean
.PRECIOUS: $(VENV)/.installed-%

# The demo's configs are the tiny ones with fewer steps (tests/test_demo_configs.py). Each run
# shows a progress bar; --verbose on a comparison also lists every converted module and RL step.
demo: $(VENV)/.installed-demo
	$(VENV)/bin/fp4stack data build --sources wikipedia --vocab-size 4096 --max-chars 3M \
		--out runs/data/tiny
	$(VENV)/bin/fp4stack compare --config configs/pretrain/demo.yaml \
		--recipes bf16,nvfp4,lowrank --out runs/compare/demo
	$(VENV)/bin/fp4stack rl-compare --config configs/rl/demo.yaml --out runs/rl-compare/demo

test: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check $(LINT_PATHS)

# The venv with torch in it. Torch is pinned and installed on its own, before anything else.
$(VENV)/.installed-torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) )"$(TORCH)"
	touch $@

# The project (editable) with an extra; torch is repeated so pip keeps the pinned build.
$(VENV)/.installed-base: pyproject.toml $(VENV)/.installed-torch
	$(PIP) install -e . "$(TORCH)"
	touch $@

$(VENV)/.installed-%: pyproject.toml $(VENV)/.installed-torch
	$(PIP) install -e ".[$*]" "$(TORCH)"
	touch $@

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find $(LINT_PATHS) -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
