#!/usr/bin/env bash
# `make test-gpu`: the GPU checks in one run, under 5 minutes, on a machine with one or
# more GPUs and no package index (docs/gpu.md).
#
# Python: $PYTHON (default python3) as it is, when it has a CUDA build of torch. No venv
# is made (a venv made from a venv's python does not see the first one's packages).
# Whatever nereus and its GPU tests import that this Python lacks (pyzmq,
# pytest-asyncio, ...) is installed from the wheels in .wheels/ (git-ignored, carried
# with the working tree; `make gpu-wheels` fills it where a package index is reachable)
# into .gpu-site/ (git-ignored), which goes on PYTHONPATH after the checkout. Nothing
# else is installed: vLLM is used where it is importable, and its tests skip otherwise.
#
# Then, each under its own timeout: the `gpu` test tier, then benchmarks.gpu (whose last
# line is one JSON object). Logs go to gpu-logs/: preflight.txt, tier.txt, tier.xml,
# bench.txt, bench.json. Exit status: 0 when both passed; 3 when no GPU is visible;
# 2 when a needed package is neither present nor installable from .wheels/; else the
# status of the first part that failed (124: it ran past its timeout).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=${NEREUS_WHEELS:-.wheels}
SITE=${GPU_SITE:-.gpu-site}
LOGS=${GPU_LOGS:-gpu-logs}
TOTAL_S=${TOTAL_S:-290}
TIER_TIMEOUT_S=${TIER_TIMEOUT_S:-165}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-100}
started=$SECONDS

mkdir -p "$LOGS"
say() { echo "test-gpu: $*" | tee -a "$LOGS/preflight.txt"; }
: > "$LOGS/preflight.txt"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    say "no $PYTHON on PATH; PYTHON=... must name the Python that has a CUDA build of torch"
    exit 2
fi

# 1. A Python with torch (a CUDA build is checked below, with the GPU).
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    say "$("$PYTHON" -c 'import sys; print(sys.executable)') has no torch; PYTHON=... must name the Python that has a CUDA build of torch"
    exit 2
fi

mkdir -p "$SITE"
case $SITE in /*) ;; *) SITE="$PWD/$SITE" ;; esac
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# 2. What is missing, from the carried wheels: module -> distribution, and the
#    distributions each one needs (installed without resolving: no index here).
missing=$("$PYTHON" - <<'PYCHECK'
import importlib.util

NEED = {  # module: (distribution, modules it needs)
    "zmq": ("pyzmq", []), "msgpack": ("msgpack", []), "uvloop": ("uvloop", []),
    "numpy": ("numpy", []), "safetensors": ("safetensors", []),
    "tokenizers": ("tokenizers", []), "jinja2": ("jinja2", ["markupsafe"]),
    "markupsafe": ("markupsafe", []),
    "rich": ("rich", ["markdown_it", "pygments"]), "markdown_it": ("markdown-it-py", ["mdurl"]),
    "mdurl": ("mdurl", []), "pygments": ("pygments", []),
    "pytest": ("pytest", ["pluggy", "iniconfig", "packaging"]), "pluggy": ("pluggy", []),
    "iniconfig": ("iniconfig", []), "packaging": ("packaging", []),
    "pytest_asyncio": ("pytest-asyncio", ["pytest", "typing_extensions"]),
    "typing_extensions": ("typing-extensions", []), "pytest_timeout": ("pytest-timeout", ["pytest"]),
}
want, todo = [], list(NEED)
while todo:
    mod = todo.pop(0)
    dist, deps = NEED[mod]
    if importlib.util.find_spec(mod) is None and dist not in want:
        want.append(dist)
        todo.extend(deps)
print(" ".join(want))
PYCHECK
)
if [ -n "$missing" ]; then
    files=()
    for dist in $missing; do
        stem=$(echo "$dist" | tr '-' '_' | tr 'A-Z' 'a-z')
        found=$(ls "$WHEELS"/"$stem"-[0-9]*.whl 2>/dev/null | head -n 1)
        if [ -z "$found" ]; then
            say "$dist is missing and $WHEELS/ has no wheel of it: run \`make gpu-wheels\` where a package index is reachable, then carry $WHEELS/ in with the checkout"
            exit 2
        fi
        files+=("$found")
    done
    say "installing from $WHEELS/ into $SITE/: $missing"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "${files[@]}" \
            >>"$LOGS/preflight.txt" 2>&1
    else  # no pip: a wheel is a zip laid out for site-packages
        "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$SITE" "${files[@]}" >>"$LOGS/preflight.txt" 2>&1
    fi
    if [ $? -ne 0 ]; then
        say "could not install ${files[*]} into $SITE/ (see $LOGS/preflight.txt)"
        exit 2
    fi
fi

# 3. A CUDA torch and a visible GPU, or a plain statement of what is missing.
"$PYTHON" - >>"$LOGS/preflight.txt" 2>&1 <<'PYCHECK'
import sys
try:
    import torch
except ImportError as e:
    print(f"test-gpu: {sys.executable} has no torch ({e}); PYTHON=... must name the Python "
          "that has a CUDA build of torch")
    sys.exit(2)
if torch.version.cuda is None:
    print(f"test-gpu: NO GPU: {sys.executable} has torch {torch.__version__}, a build without "
          "CUDA")
    sys.exit(3)
if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    print(f"test-gpu: NO GPU is visible: torch {torch.__version__} (CUDA {torch.version.cuda}) "
          "sees no CUDA device (driver missing, or CUDA_VISIBLE_DEVICES hides them)")
    sys.exit(3)
names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"test-gpu: python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), {torch.cuda.device_count()} GPU(s): {names}")
PYCHECK
status=$?
tail -n 1 "$LOGS/preflight.txt"
if [ $status -ne 0 ]; then
    exit $status
fi

"$PYTHON" - >>"$LOGS/preflight.txt" 2>&1 <<'PYCHECK'
import importlib.util, sys
import nereus
from nereus.transfer import _libnccl
lib = _libnccl.library()
print(f"test-gpu: nereus from {nereus.__file__}; libnccl {_libnccl.version()} ({lib._name}); "
      f"vllm {'importable' if importlib.util.find_spec('vllm') else 'absent: its tests skip'}")
PYCHECK
status=$?
tail -n 1 "$LOGS/preflight.txt"
if [ $status -ne 0 ]; then
    say "nereus or libnccl does not load (see $LOGS/preflight.txt)"
    exit 2
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
result=0

# 4. The gpu tier. Test files named here only: the rest of the suite needs packages
#    (hypothesis, transformers, ...) this machine is not given.
left=$((TOTAL_S - (SECONDS - started)))
limit=$((TIER_TIMEOUT_S < left ? TIER_TIMEOUT_S : left))
say "gpu tier (timeout ${limit} s) -> $LOGS/tier.txt"
timeout -k 10 "$limit" "$PYTHON" -m pytest -m gpu -q -rs -p no:cacheprovider \
    --junitxml="$LOGS/tier.xml" \
    tests/transfer/test_nccl.py tests/transfer/test_bucket_streams.py \
    tests/engines/test_gpu.py tests/job/test_gpu_job.py 2>&1 | tee "$LOGS/tier.txt"
status=${PIPESTATUS[0]}
[ $status -ne 0 ] && [ $result -eq 0 ] && result=$status

# 5. benchmarks.gpu, in what time is left.
left=$((TOTAL_S - (SECONDS - started)))
limit=$((BENCH_TIMEOUT_S < left ? BENCH_TIMEOUT_S : left))
if [ "$limit" -lt 20 ]; then
    say "benchmarks.gpu not run: ${left} s left of ${TOTAL_S} s"
    [ $result -eq 0 ] && result=124
else
    say "benchmarks.gpu (timeout ${limit} s) -> $LOGS/bench.txt"
    timeout -k 10 "$limit" "$PYTHON" -m benchmarks.gpu 2>&1 | tee "$LOGS/bench.txt"
    status=${PIPESTATUS[0]}
    grep '^{' "$LOGS/bench.txt" | tail -n 1 > "$LOGS/bench.json"
    [ $status -ne 0 ] && [ $result -eq 0 ] && result=$status
fi
say "done in $((SECONDS - started)) s, status $result; logs in $LOGS/"
exit $result
