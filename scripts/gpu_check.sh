#!/usr/bin/env bash
# The project's one GPU check, in one call of at most 6 minutes on a fresh GPU machine: build for this GPU, criticalkv
# bench gpu, pytest -m gpu, compute-sanitizer, criticalkv bench gpu-serve; each step under its own time limit, results
# (summary.md first) under $OUT or --out. Without CUDA it skips the GPU steps and runs the CPU dry runs.
#
#   bash scripts/gpu_check.sh --help                        # every option, the steps, the default limits
#   bash scripts/gpu_check.sh --commit <git head>           # a copy without .git (docs/gpu_check.md)
#   bash scripts/gpu_check.sh --dry-run --out /tmp/check    # anywhere
#
# Python: $PYTHON, else .venv/bin/python, else python3 (a bare GPU machine has no venv). The driver is
# benchmarks/gpu_check.py; it imports only the standard library and installs nothing but the carried wheels
# (pip install --no-deps --no-index --target into a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check.sh: error: no Python interpreter ($PY); set PYTHON" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check "$@"
