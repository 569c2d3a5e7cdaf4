#!/usr/bin/env bash
# Build the CriticalKV kernels, the host C++ version and the TensorRT plugin into build/plugins.
#
#   bash scripts/build_plugin.sh                      # CPU machine / CI: TensorRT headers from the kernel-lens wheel
#   TRT_INCLUDE_DIR=/usr/include/x86_64-linux-gnu bash scripts/build_plugin.sh   # GPU box with TensorRT installed
#
# Environment: TRT_INCLUDE_DIR (headers to use; see the search order below), TENSORRT_ROOT, TRT_HEADERS_DIR (where
# downloaded headers are unpacked and a carried kernel-lens wheel is looked for; default build/trt-headers),
# CKV_CUDA_ARCHS (default "80;90"),
# BUILD_DIR (default build/plugins), PYTHON (for `pip download`; default .venv/bin/python, else python3),
# CKV_WERROR (default ON), CKV_BUILD_JOBS (default nproc), CUDA_HOME (where nvcc is looked for after PATH; default
# /usr/local/cuda), CKV_REQUIRE_CUDA (1: fail without nvcc, as when CKV_CUDA_ARCHS is given), CKV_TORCH (default ON:
# the torch ops libcriticalkv_torch.so against $PYTHON's torch, its CUDA registration where that torch has CUDA; OFF:
# not built).
# Needs CMake >= 3.24 and a C++ compiler; the CUDA kernels and the TensorRT plugin need nvcc (the CUDA toolkit, 12.x
# or 13.x). Without nvcc only the host library and the torch ops' CPU kernels are built, and the script says so; when
# the kernels are asked for (CKV_CUDA_ARCHS set, or CKV_REQUIRE_CUDA=1) a missing nvcc is an error. Each missing piece
# is named, exit 2.
# Only the TensorRT plugin needs TensorRT's headers: without them (none installed, none carried, no network) the
# plugin is skipped with the reason and everything else is built. When torch's CMake config fails (find_package(Torch),
# e.g. its cuda.cmake against another CUDA toolkit), the configure is retried without the torch ops and says so.
# The TensorRT headers are unpacked under build/ and never committed.
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    "") ;;
    *) echo "build_plugin.sh: error: unknown argument '$1' (it takes none; see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build/plugins}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# CUDA kernels asked for: an explicit CKV_CUDA_ARCHS (docs/gpu.md: "CKV_CUDA_ARCHS=90 bash scripts/build_plugin.sh")
if [ -n "${CKV_CUDA_ARCHS:-}" ] || [ "${CKV_REQUIRE_CUDA:-0}" = 1 ]; then REQUIRE_CUDA=ON; else REQUIRE_CUDA=OFF; fi
CKV_CUDA_ARCHS=${CKV_CUDA_ARCHS:-80;90}
CKV_WERROR=${CKV_WERROR:-ON}

missing() { echo "build_plugin.sh: error: $*" >&2; exit 2; }
# What the build needs, checked before anything is written. A cmake installed in the Python environment
# (`.venv/bin/pip install 'cmake>=3.24'`, for a distribution whose own is older) comes first.
case "$PYTHON" in */*) [ -x "$(dirname "$PYTHON")/cmake" ] && export PATH="$(cd "$(dirname "$PYTHON")" && pwd):$PATH" ;; esac
command -v cmake >/dev/null 2>&1 || missing "cmake not found: CMake >= 3.24 is needed (pip install 'cmake>=3.24', or" \
    "your distribution's cmake package)"
CMAKE_VERSION=$(cmake --version | head -n 1 | awk '{print $3}')
if [ "$(printf '%s\n3.24\n' "$CMAKE_VERSION" | sort -V | head -n 1)" != 3.24 ]; then
    missing "cmake $CMAKE_VERSION is too old: CMake >= 3.24 is needed (pip install 'cmake>=3.24')"
fi
if [ -n "${CXX:-}" ]; then
    command -v "$CXX" >/dev/null 2>&1 || missing "CXX=$CXX: no such C++ compiler"
elif ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
    missing "no C++ compiler (c++, g++ or clang++ on PATH, or CXX): install one (Debian/Ubuntu: apt-get install g++)"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    export PATH=${CUDA_HOME:-/usr/local/cuda}/bin:$PATH
fi
if ! command -v nvcc >/dev/null 2>&1; then
    if [ "$REQUIRE_CUDA" = ON ]; then
        missing "the CUDA kernels were asked for (CKV_CUDA_ARCHS=$CKV_CUDA_ARCHS${CKV_REQUIRE_CUDA:+, CKV_REQUIRE_CUDA=$CKV_REQUIRE_CUDA})" \
            "but nvcc is not on PATH nor in ${CUDA_HOME:-/usr/local/cuda}/bin: install the CUDA toolkit (12.x or 13.x," \
            "docs/gpu.md) or set CUDA_HOME to it; without CKV_CUDA_ARCHS only the host library is built"
    fi
    echo "nvcc not found: building the host library only (no CUDA kernels, no torch op, no TensorRT plugin)"
fi
KERNEL_LENS=kernel-lens==2.0.1

# One build per build folder at a time: pytest-xdist workers (scripts/gpu_check.sh) each run this script from their
# session fixture, and two cmake runs rewriting one tree at once can break it; the later ones find it up to date.
mkdir -p "$BUILD_DIR"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$BUILD_DIR/.build.lock"
    flock 9
fi

# TensorRT headers, first found wins (no network needed except for the last step):
#   1. TRT_INCLUDE_DIR;  2. an installed TensorRT (TENSORRT_ROOT/include, /usr/include/x86_64-linux-gnu,
#   /usr/include, /usr/local/tensorrt/include);  3. headers unpacked earlier into TRT_HEADERS_DIR;
#   4. a kernel-lens wheel placed in TRT_HEADERS_DIR (offline copy);  5. `pip download` of that wheel.
# None found: the plugin (and its test harness) is skipped, the rest is built. A TRT_INCLUDE_DIR without NvInfer.h is
# an error (it was asked for).
HEADERS=${TRT_HEADERS_DIR:-build/trt-headers}
case "$HEADERS" in /*) ;; *) HEADERS=$ROOT/$HEADERS ;; esac
TRT_SKIPPED=""
if [ -n "${TRT_INCLUDE_DIR:-}" ]; then
    if [ ! -f "$TRT_INCLUDE_DIR/NvInfer.h" ]; then
        echo "build_plugin.sh: error: TRT_INCLUDE_DIR=$TRT_INCLUDE_DIR has no NvInfer.h" >&2
        exit 2
    fi
else
    for candidate in ${TENSORRT_ROOT:+"$TENSORRT_ROOT/include"} /usr/include/x86_64-linux-gnu /usr/include \
                     /usr/local/tensorrt/include; do
        if [ -f "$candidate/NvInfer.h" ]; then TRT_INCLUDE_DIR=$candidate; break; fi
    done
fi
if [ -z "${TRT_INCLUDE_DIR:-}" ]; then
    TRT_INCLUDE_DIR=$HEADERS/kernel_lens/include/tensorrt
    if [ ! -f "$TRT_INCLUDE_DIR/NvInfer.h" ]; then
        mkdir -p "$HEADERS"
        if ! ls "$HEADERS"/kernel_lens-*.whl >/dev/null 2>&1; then
            echo "fetching TensorRT 10 headers ($KERNEL_LENS) into $HEADERS"
            if ! "$PYTHON" -m pip download --quiet --no-deps --dest "$HEADERS" "$KERNEL_LENS"; then
                TRT_SKIPPED="no TensorRT headers: none installed, none in $HEADERS, and $KERNEL_LENS could not be
                    downloaded (offline?); set TRT_INCLUDE_DIR to the folder holding NvInfer.h, or copy the
                    kernel_lens-2.0.1 wheel into $HEADERS"
                TRT_SKIPPED=$(echo $TRT_SKIPPED)  # one line
            fi
        fi
        if [ -z "$TRT_SKIPPED" ]; then
            "$PYTHON" - "$HEADERS" <<'PY'
import glob, sys, zipfile
folder = sys.argv[1]
wheel = sorted(glob.glob(f"{folder}/kernel_lens-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    z.extractall(folder, [n for n in z.namelist() if n.startswith("kernel_lens/include/tensorrt/")])
PY
        fi
    fi
fi
if [ -n "$TRT_SKIPPED" ]; then
    TRT_INCLUDE_DIR=""
    echo "TensorRT plugin: skipped ($TRT_SKIPPED)"
else
    echo "TensorRT headers: $TRT_INCLUDE_DIR"
fi

# The torch ops are built against the torch of $PYTHON (its CMake config; the CPU wheel ships the headers): the CPU
# registration always, the CUDA one where that torch has CUDA.
TORCH_PREFIX=""
TORCH_CUDA=OFF
if [ "${CKV_TORCH:-ON}" != "OFF" ]; then
    if TORCH_INFO=$("$PYTHON" -c "import torch; print(torch.utils.cmake_prefix_path); print('ON' if torch.version.cuda else 'OFF')" 2>/dev/null); then
        TORCH_PREFIX=$(echo "$TORCH_INFO" | sed -n 1p)
        TORCH_CUDA=$(echo "$TORCH_INFO" | sed -n 2p)
        echo "torch ops: against $TORCH_PREFIX (CUDA registration: $TORCH_CUDA)"
    else
        echo "torch ops: $PYTHON has no torch; libcriticalkv_torch.so is not built"
    fi
fi

GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
# configure TORCH_PREFIX: the first configure of a build folder prints CMake's messages, a reconfigure only on failure;
# both are kept in $BUILD_DIR/configure.log
configure() {
    local options=(-DTRT_INCLUDE_DIR="$TRT_INCLUDE_DIR" -DCKV_CUDA_ARCHS="$CKV_CUDA_ARCHS" -DCKV_WERROR="$CKV_WERROR"
                   -DCKV_REQUIRE_CUDA="$REQUIRE_CUDA" -DCKV_TORCH_PREFIX="$1" -DCKV_TORCH_CUDA="$TORCH_CUDA")
    if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
        cmake -S plugins -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release "${options[@]}" 2>&1 \
            | tee "$BUILD_DIR/configure.log"
    elif ! cmake "$BUILD_DIR" "${options[@]}" >"$BUILD_DIR/configure.log" 2>&1; then
        cat "$BUILD_DIR/configure.log"
        return 1
    fi
}
TORCH_SKIPPED=""
if ! configure "$TORCH_PREFIX"; then
    [ -n "$TORCH_PREFIX" ] || exit 1
    # torch's CMake config (find_package(Torch): its cuda.cmake checks the CUDA toolkit against the one torch was built
    # with) can fail where the kernels themselves build: the rest is built without the torch ops
    TORCH_SKIPPED="torch's CMake config failed (find_package(Torch) against $TORCH_PREFIX; $BUILD_DIR/configure.log
        kept as configure-torch.log)"
    TORCH_SKIPPED=$(echo $TORCH_SKIPPED)
    cp "$BUILD_DIR/configure.log" "$BUILD_DIR/configure-torch.log"
    echo "torch ops: skipped ($TORCH_SKIPPED); configuring again without them"
    configure "" || exit 1
fi
# what this configuration does not build must not be found stale in the folder
[ -z "$TRT_SKIPPED" ] || rm -f "$BUILD_DIR/libcriticalkv_trt_plugin.so" "$BUILD_DIR/libcriticalkv_plugin_harness.so"
[ -z "$TORCH_SKIPPED" ] || rm -f "$BUILD_DIR/libcriticalkv_torch.so"
cmake --build "$BUILD_DIR" --parallel "${CKV_BUILD_JOBS:-$(nproc)}"
BUILT="the host library"
if command -v nvcc >/dev/null 2>&1; then
    BUILT="$BUILT, the CUDA kernels (sm $CKV_CUDA_ARCHS), the sanitizer driver"
fi
[ -f "$BUILD_DIR/libcriticalkv_torch.so" ] && BUILT="$BUILT, the torch ops"
[ -f "$BUILD_DIR/libcriticalkv_trt_plugin.so" ] && BUILT="$BUILT, the TensorRT plugin"
NOT_BUILT=()
command -v nvcc >/dev/null 2>&1 || NOT_BUILT+=("the CUDA kernels and the TensorRT plugin (no nvcc; the ops' CPU kernels only)")
[ -z "$TORCH_SKIPPED" ] || NOT_BUILT+=("the torch ops ($TORCH_SKIPPED)")
if [ -n "$TRT_SKIPPED" ] && command -v nvcc >/dev/null 2>&1; then NOT_BUILT+=("the TensorRT plugin ($TRT_SKIPPED)"); fi
echo "built into $BUILD_DIR: $BUILT"
for item in "${NOT_BUILT[@]}"; do echo "not built: $item"; done
