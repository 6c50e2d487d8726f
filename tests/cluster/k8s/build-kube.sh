#!/bin/bash
# Builds Kubernetes 1.20.2 -- the control plane (kube-apiserver, kube-controller-manager, kube-scheduler) and
# a node (kubelet, kube-proxy) -- from Debian bookworm's `kubernetes` source package with Debian's Go, offline;
# plus kubectl 1.20 and etcd. Adapted from the verified recipe in the project's shared k8s/build-kube-1.20.sh
# (cpio and make installed, the build tree removed afterwards). About 13-20 minutes cold on 2 cores (the
# kubelet is ~6 of them); builds only the binaries missing, so it returns at once when
# ~/.cache/basin-k8s/bin holds them all.
# Usage: bash tests/cluster/k8s/build-kube.sh   (OUT=... to build elsewhere)
set -euo pipefail
W=${W:-${XDG_CACHE_HOME:-$HOME/.cache}/basin-k8s/build}
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/basin-k8s/bin}
BINS=${BINS:-"kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy"}
missing=""; for b in $BINS; do [ -x "$OUT/$b" ] || missing="$missing $b"; done
command -v etcd >/dev/null || apt-get install -y --no-install-recommends etcd-server >/dev/null
if [ ! -x "$OUT/kubectl" ]; then  # kubectl 1.20 from Debian's kubernetes-client package, unpacked (not installed)
  mkdir -p "$OUT" && K=$(mktemp -d) && (cd "$K" && apt-get download kubernetes-client >/dev/null 2>&1 && dpkg-deb -x kubernetes-client_*.deb x) \
    && cp "$K/x/usr/bin/kubectl" "$OUT/kubectl"; rm -rf "$K"
fi
if [ -z "$missing" ]; then "$OUT/kube-apiserver" --version; exit 0; fi
echo "building$missing into $OUT (several minutes, once)"
rm -rf "$W" && mkdir -p "$W/apt/lists/partial" "$W/apt/cache/archives/partial" "$OUT" && cd "$W"
apt-get install -y --no-install-recommends golang-go rsync jq etcd-server openssl curl cpio make \
  golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev >/dev/null
echo 'deb-src http://deb.debian.org/debian bookworm main' > apt/src.list
A="-o Dir::Etc::SourceList=$W/apt/src.list -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists=$W/apt/lists -o Dir::Cache=$W/apt/cache"
apt-get $A update >/dev/null 2>&1 && apt-get $A source --download-only kubernetes >/dev/null 2>&1
tar xzf kubernetes_*.orig.tar.gz && cd kubernetes-1.20.2
# The vendored reflect2 v1.0.1 / json-iterator v1.1.10 segfault on Go >= 1.18 (first custom-resource create):
# swap in Debian's reflect2 1.0.2 and json-iterator 1.1.12.
for m in modern-go/reflect2 json-iterator/go; do
  rm -rf vendor/github.com/$m && mkdir -p vendor/github.com/$m
  (cd /usr/share/gocode/src/github.com/$m && find . \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' ! -path './test*' \
     | cpio -pdm --quiet "$W/kubernetes-1.20.2/vendor/github.com/$m")
done
sed -i 's#modern-go/reflect2 v1.0.1#modern-go/reflect2 v1.0.2#g; s#json-iterator/go v1.1.10#json-iterator/go v1.1.12#g' vendor/modules.txt
export GOPROXY=off CGO_ENABLED=0 GOCACHE=$W/gocache HOME=$W/home KUBE_GIT_VERSION=v1.20.2 \
  KUBE_GIT_COMMIT=faecb196815e248d3ecfb03c680a4507229c2a56 KUBE_GIT_TREE_STATE=clean KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20
mkdir -p "$HOME"
make WHAT="$(for b in $missing; do printf 'cmd/%s ' $b; done)" GOLDFLAGS="-s -w" >/dev/null
for b in $missing; do cp "_output/local/bin/linux/amd64/$b" "$OUT/"; done
cd / && rm -rf "$W"  # the source tree and Go cache are ~2 GB; the binaries are what we keep
"$OUT/kube-apiserver" --version
