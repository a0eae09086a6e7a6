#!/usr/bin/env bash
# `make test-gpu`: the GPU checks in one run, within 5 minutes, on a machine with one or
# more GPUs and no network.
#
# It uses the Python, torch (a CUDA build) and libnccl it finds (a venv that sees the
# system's packages, .venv-gpu), runs nereus from the checkout (PYTHONPATH, nothing to
# build), and installs only the small packages that are missing from wheels carried in
# beside the checkout ($NEREUS_WHEELS, default ../wheels; `make gpu-wheels` fills it on
# a machine with network). Then: the `gpu` test tier (among it tests/job/test_gpu_job.py:
# a few GRPO steps on GPU workers, built-in generation and, where vLLM is installed, vLLM
# with in-place weight loads; skipped with the reason where it is not), and
# benchmarks.gpu, whose last line is one JSON object (nccl_p2p_gbps, device_copy_gbps,
# grpo_steps, weight_load_s).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${NEREUS_WHEELS:-../wheels}
VENV=${GPU_VENV:-.venv-gpu}
TIER_TIMEOUT_S=${TIER_TIMEOUT_S:-180}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-120}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"

"$PY" - <<'PYCHECK'
import sys
try:
    import torch
except ImportError:
    sys.exit(f"test-gpu: {sys.executable} has no torch; PYTHON=... must name the Python "
             "that has the CUDA build of torch")
if not torch.cuda.is_available():
    sys.exit(f"test-gpu: torch {torch.__version__} sees no CUDA device")
print(f"test-gpu: python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PYCHECK

# module -> the distribution that provides it
missing=$("$PY" - <<'PYCHECK'
import importlib.util
need = {"zmq": "pyzmq", "msgpack": "msgpack", "numpy": "numpy", "safetensors": "safetensors",
        "tokenizers": "tokenizers", "rich": "rich", "matplotlib": "matplotlib",
        "pytest": "pytest", "pytest_asyncio": "pytest-asyncio", "pytest_timeout": "pytest-timeout"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
PYCHECK
)
if [ -n "$missing" ]; then
    echo "test-gpu: installing $missing from $WHEELS"
    if ! "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" $missing; then
        echo "test-gpu: $missing must be carried in as wheels for this Python into $WHEELS" >&2
        echo "          (on a machine with network: make gpu-wheels GPU_PYTHON_VERSION=3.12)" >&2
        exit 2
    fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -c "from nereus.transfer import _libnccl; print('test-gpu: libnccl', _libnccl.version(), _libnccl.library()._name)"

status=0
timeout "$TIER_TIMEOUT_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs \
    tests/transfer/test_nccl.py tests/engines/test_gpu.py tests/job/test_gpu_job.py || status=$?
timeout "$BENCH_TIMEOUT_S" "$PY" -m benchmarks.gpu || status=$?
exit $status
