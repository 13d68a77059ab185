# Two commands do everything on a fresh machine:
#   make demo   — install, then run the main job (the end-to-end demo)
#   make test   — install, then run the test suite
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo quickstart test lint docs bench

# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
install:
	@$(PYTHON) -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 5))" 2>/dev/null \
		|| $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,demo,docs,dev]"

demo: install
	$(PYTHON) examples/demo.py

quickstart: install
	$(PYTHON) examples/quickstart.py

test: install
	$(PYTHON) -m pytest -q

lint:
	ruff check flexmask tests benchmarks examples
	ruff format --check flexmask tests benchmarks examples
	mypy flexmask

docs:
	mkdocs build --strict

bench:
	$(PYTHON) benchmarks/run_all.py
