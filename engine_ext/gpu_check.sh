#!/usr/bin/env bash
# One prepared check of the engine extension on an H200 (no network there): the Triton layer-wait
# kernel and the unit page copy on the GPU, printing latency and bandwidth; bounded to 5 minutes.
# Needs torch and triton (the H200 image has both). Any other package travels as wheels in
# $BASIN_GPU_WHEELS (default engine_ext/.gpu-wheels, ignored by git), installed offline here first.
# Usage (repository root):  bash engine_ext/gpu_check.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WHEELS=${BASIN_GPU_WHEELS:-$HERE/.gpu-wheels}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/basin-site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/basin-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 280 python3 "$HERE/gpu_check.py" "$@"
