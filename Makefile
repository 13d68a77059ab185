# Two commands do everything on a fresh machine:
#   make demo   — install, then run the main job (the end-to-end demo)
#   make test   — install, then run the test suite (the slow tests: make test-slow)
#
# Where it installs: the active virtual environment if there is one ($VIRTUAL_ENV), else a
# project-local one, .venv, made here — never a distribution's Python (PEP 668 refuses that)
# nor another Python's global site. .venv sees the system's packages, so an installed
# torch in the declared range (2.13 to 2.14) is kept (CUDA builds included); where there is none, torch==2.13.0 is installed
# from pip's configured sources, or from $TORCH_INDEX_URL when set (PyTorch's CPU index, say:
# a bare `torch` from PyPI on Linux is the multi-GB CUDA build). pip runs again only when
# pyproject.toml changes (a stamp in the environment).
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := .venv
endif
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.flexmask-installed
SYSTEM_PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
# Parallel tests: pytest-xdist, one worker per core, one torch thread per worker (measured on
# 2 busy cores: 167 s with one thread per worker against 300 s with torch's default, whose
# OpenMP threads spin-wait on cores the other worker holds).
PYTEST_WORKERS ?= auto
TEST_THREADS ?= 1
# Only the pytest plugins the project declares (.venv sees the system's packages, where a
# globally installed plugin, pytest-benchmark say, would otherwise load into the run).
PYTEST := PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(PYTHON) -m pytest -p xdist.plugin -p _hypothesis_pytestplugin

.PHONY: install demo quickstart test test-slow lint docs bench clean-venv print-python print-pytest print-torch-spec

install: $(STAMP)

$(PYTHON):
	$(SYSTEM_PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): pyproject.toml | $(PYTHON)
	@echo "installing flexmask and its test/demo/docs/dev tools into $(VENV) (about a minute; pip's progress follows)"
	@$(PYTHON) -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(not (2, 13) <= v < (2, 15))" 2>/dev/null \
		&& echo "keeping torch $$($(PYTHON) -c 'import torch; print(torch.__version__)')" \
		|| $(PYTHON) -m pip install --progress-bar on "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)")
	$(PYTHON) -m pip install --progress-bar on -e ".[test,demo,docs,dev]"
	@touch $@

demo: $(STAMP)
	$(PYTHON) examples/demo.py

quickstart: $(STAMP)
	$(PYTHON) examples/quickstart.py

test: $(STAMP)
	OMP_NUM_THREADS=$(TEST_THREADS) $(PYTEST) -q -m "not slow" -n $(PYTEST_WORKERS)

test-slow: $(STAMP)
	$(PYTEST) -q -m slow

lint: $(STAMP)
	$(PYTHON) -m ruff check flexmask tests benchmarks examples .ci
	$(PYTHON) -m ruff format --check flexmask tests benchmarks examples .ci
	$(PYTHON) -m mypy flexmask

docs: $(STAMP)
	$(PYTHON) -m mkdocs build --strict

bench: $(STAMP)
	$(PYTHON) benchmarks/run_all.py

clean-venv:
	rm -rf .venv

print-python:  # for scripts: the interpreter the targets use
	@echo $(abspath $(PYTHON))

print-pytest:  # for tests: the pytest command the test targets run
	@echo "$(PYTEST)"

print-torch-spec:  # for scripts: the torch requirement installed where none is found
	@echo "$(TORCH_SPEC)"
