#!/usr/bin/env bash
# Build the CriticalKV kernels, the host C++ version and the TensorRT plugin into build/plugins.
#
#   bash scripts/build_plugin.sh                      # CPU machine / CI: TensorRT headers from the kernel-lens wheel
#   TRT_INCLUDE_DIR=/usr/include/x86_64-linux-gnu bash scripts/build_plugin.sh   # GPU box with TensorRT installed
#
# Environment: TRT_INCLUDE_DIR (skip the header download), CKV_CUDA_ARCHS (default "80;90"),
# BUILD_DIR (default build/plugins), PYTHON (for `pip download`; default .venv/bin/python, else python3),
# CKV_WERROR (default ON), CKV_BUILD_JOBS (default nproc).
# The TensorRT headers are unpacked under build/ and never committed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build/plugins}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
CKV_CUDA_ARCHS=${CKV_CUDA_ARCHS:-80;90}
CKV_WERROR=${CKV_WERROR:-ON}
KERNEL_LENS=kernel-lens==2.0.1

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
fi

if [ -z "${TRT_INCLUDE_DIR:-}" ]; then
    HEADERS=build/trt-headers
    TRT_INCLUDE_DIR=$ROOT/$HEADERS/kernel_lens/include/tensorrt
    if [ ! -f "$TRT_INCLUDE_DIR/NvInfer.h" ]; then
        echo "fetching TensorRT 10 headers ($KERNEL_LENS) into $HEADERS"
        rm -rf "$HEADERS" && mkdir -p "$HEADERS"
        "$PYTHON" -m pip download --quiet --no-deps --dest "$HEADERS" "$KERNEL_LENS"
        "$PYTHON" - "$HEADERS" <<'PY'
import glob, sys, zipfile
folder = sys.argv[1]
wheel = glob.glob(f"{folder}/kernel_lens-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(folder, [n for n in z.namelist() if n.startswith("kernel_lens/include/tensorrt/")])
PY
    fi
fi

GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    cmake -S plugins -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DTRT_INCLUDE_DIR="$TRT_INCLUDE_DIR" -DCKV_CUDA_ARCHS="$CKV_CUDA_ARCHS" -DCKV_WERROR="$CKV_WERROR"
else
    cmake "$BUILD_DIR" -DTRT_INCLUDE_DIR="$TRT_INCLUDE_DIR" -DCKV_CUDA_ARCHS="$CKV_CUDA_ARCHS" \
        -DCKV_WERROR="$CKV_WERROR" >/dev/null
fi
cmake --build "$BUILD_DIR" --parallel "${CKV_BUILD_JOBS:-$(nproc)}"
echo "built into $BUILD_DIR"
