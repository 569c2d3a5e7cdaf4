#!/usr/bin/env bash
# Serve an engine with TensorRT from inside NVIDIA's tritonserver container (docs/gpu.md, "NVIDIA's container"):
# criticalkv is installed into a virtual environment beside the container's CUDA torch and TensorRT (both kept as
# they are), the plugin is built against the container's TensorRT headers, the engine is built there too when
# CKV_BUILD_ARGS is set (TensorRT engines only load in the TensorRT version that built them), and `criticalkv serve`
# runs the container's own tritonserver (/opt/tritonserver) with the OpenAI-compatible API in front.
#
#   bash scripts/container_serve.sh ENGINE_DIR [criticalkv serve options ...]
#   CKV_BUILD_ARGS="--kv-policy criticalkv --budget 256 --max-batch-size 8" bash scripts/container_serve.sh ENGINE_DIR
#
# Environment: CKV_BUILD_ARGS (scripts/build_engine.py options: build ENGINE_DIR first), VENV (default
# /opt/criticalkv), TRITON_DIR (default /opt/tritonserver), CKV_CUDA_ARCHS (default: this GPU's).
# The plugin library lands in build/plugins-trt<version> and is named to the server by CRITICALKV_PLUGIN_LIBRARY.
set -euo pipefail
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    "") usage >&2; echo "container_serve.sh: error: give the engine directory" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
ENGINE=$1
shift
VENV=${VENV:-/opt/criticalkv}
TRITON_DIR=${TRITON_DIR:-/opt/tritonserver}
if [ ! -x "$TRITON_DIR/bin/tritonserver" ]; then
    echo "container_serve.sh: error: no $TRITON_DIR/bin/tritonserver: run this inside NVIDIA's tritonserver" \
         "container (docs/gpu.md) or set TRITON_DIR" >&2
    exit 2
fi
# the container's torch (a CUDA build) and TensorRT stay: the environment sees them and pip may not replace them
[ -x "$VENV/bin/python" ] || python3 -m venv --system-site-packages "$VENV"
python3 -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|tensorrt[a-z0-9_-]*)==' > "$VENV/keep.txt" || true
PYTHONWARNINGS="ignore:Editable installation" \
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$VENV/keep.txt" -e ".[serve]"
TRT=$("$VENV/bin/python" -c "import tensorrt; print(tensorrt.__version__)")
if [ -z "${CKV_CUDA_ARCHS:-}" ]; then
    CKV_CUDA_ARCHS=$("$VENV/bin/python" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'{major}{minor}')")
fi
export CKV_CUDA_ARCHS
BUILD_DIR=build/plugins-trt$TRT PYTHON="$VENV/bin/python" bash scripts/build_plugin.sh
export CRITICALKV_PLUGIN_LIBRARY=$PWD/build/plugins-trt$TRT/libcriticalkv_trt_plugin.so
if [ -n "${CKV_BUILD_ARGS:-}" ]; then
    # shellcheck disable=SC2086  # the build options, word-split as given
    "$VENV/bin/python" scripts/build_engine.py $CKV_BUILD_ARGS --output "$ENGINE"
fi
exec "$VENV/bin/criticalkv" serve --engine-dir "$ENGINE" --backend tensorrt --tritonserver "$TRITON_DIR" \
    --host 0.0.0.0 "$@"
