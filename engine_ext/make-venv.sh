#!/usr/bin/env bash
# Builds, once per machine, the CPU-only venv in which the engine-marked tests run against SGLang
# 0.5.23's own classes (radix caches, KV pools, allocators, disaggregation queues), NIXL over UCX on
# DRAM and Triton in interpreter mode. About 2.5 GB; cached outside the repository so a clean clone
# reuses it. Returns at once when the cached venv was built by this same script.
# Usage: engine_ext/make-venv.sh [VENV_DIR]   (default: $BASIN_SGLANG_VENV or ~/.cache/basin/sglang-venv)
# Never `pip install torchvision` bare here: it pulls CUDA torch and ~4.5 GB of NVIDIA packages.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
V=${1:-${BASIN_SGLANG_VENV:-$HOME/.cache/basin/sglang-venv}}
STAMP="$V/.basin-venv-stamp"
WANT=$(cat "$0" "$HERE/torchvision_shim.py" | sha256sum | cut -c1-16)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
mkdir -p "$(dirname "$V")"
exec 9>"$V.lock"
flock 9  # one build at a time per machine (CI and a developer may start together)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0  # built by whoever held the lock before us
fi
echo "building the SGLang CPU venv in $V (once per machine; a few minutes)" >&2
rm -rf "$V"
python3 -m venv "$V"
P="$V/bin/pip"
"$P" install -q --upgrade pip
"$P" install -q torch==2.13.0                       # the CPU wheel that lies on local disk
"$P" install -q --no-deps sglang==0.5.23 triton==3.7.0 torchvision==0.28.0 nixl==1.5.1 nixl-cu13==1.5.1
"$P" install -q numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
  IPython aiohttp transformers dill apache-tvm-ffi==0.1.11 sentencepiece compressed_tensors gguf einops openai \
  partial_json_parser prometheus_client setproctitle uvicorn fastapi uvloop jsonschema xgrammar soundfile \
  python-multipart pytest hypothesis "setuptools>=77"
SITE=$("$V/bin/python" -c 'import site; print(site.getsitepackages()[0])')
cp "$HERE/torchvision_shim.py" "$SITE/"
# The shim must be imported before sglang (tests/engine/conftest.py and every helper process do so).
"$V/bin/python" - <<'PY'
import torchvision_shim  # noqa: F401
import torch
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from nixl._api import nixl_agent  # noqa: F401
import triton  # noqa: F401
c = RadixCache.create_simulated(page_size=1)
c.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=torch.tensor([10, 11, 12, 13])))
m = c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 9])))
assert m.device_prefix_len == 3, m
print("sglang CPU venv ok: RadixCache match", m.device_prefix_len)
PY
echo "$WANT" > "$STAMP"
