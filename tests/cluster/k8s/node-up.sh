#!/bin/bash
# Adds one real node — containerd + kubelet (+ kube-proxy with PROXY=1) — to the control plane that
# start-cluster.sh runs in $D (started with SCHED_PORT, so Pods get scheduled), so Pods really run.
# Adapted from the verified recipe in the project's shared k8s/node-up.sh (Kubernetes 1.20.2): the Pod
# bridge is made up front with its gateway address (BRIDGE_IP), so host-side services for the Pods (the
# test's cluster DNS and apiserver relay, tests/cluster/nodenet.py) can bind it before the first Pod, and
# CLUSTER_DNS=<ip> gives Pods that resolver and the cluster.local search path (the kubelet's clusterDNS).
# One node per machine at a time: the bridge, the iptables chains and the kubelet's ports are the host's.
# Usage: D=<cluster dir> [N=<node dir>] [PROXY=1] [CLUSTER_DNS=<ip>] bash node-up.sh [image.tar ...]
#   image.tar: docker-archive or OCI archives to load into the node (Pods use imagePullPolicy: Never;
#   there is no registry). Pod addresses live on a bridge in network namespaces this script creates.
# Stop with: D=<cluster dir> [N=...] bash node-down.sh   (run it before stop-cluster.sh)
set -euo pipefail
B=${B:-${XDG_CACHE_HOME:-$HOME/.cache}/basin-k8s/bin}
IMG=${IMG:-${XDG_CACHE_HOME:-$HOME/.cache}/basin-k8s/images}
D=${D:?set D to the folder start-cluster.sh used}; N=${N:-$D/node}
POD_CIDR=${POD_CIDR:-10.88.77.0/24}
BRIDGE_IP=${BRIDGE_IP:-10.88.77.1}
export KUBECONFIG=$D/kubeconfig
kubectl() { "${KUBECTL:-$B/kubectl}" "$@"; }
need=""; for p in containerd runc ctr buildah skopeo gcc iptables; do command -v $p >/dev/null || need=1; done
[ -d /usr/lib/cni ] || need=1
[ -z "$need" ] || apt-get install -y --no-install-recommends containerd runc containernetworking-plugins buildah skopeo gcc libc6-dev iptables >/dev/null
rm -rf "$N" && mkdir -p "$N"/containerd "$N"/kubelet/root "$N"/kubelet/certs "$N"/cni/conf "$N"/cni/netdir "$IMG"
# Remember what the kubelet and CNI change on the host, so node-down.sh can put it back.
for k in vm/overcommit_memory kernel/panic kernel/panic_on_oops net/ipv4/conf/all/route_localnet; do echo "$k=$(cat /proc/sys/$k)"; done > "$N/sysctl.orig"
ls /var/run/netns 2>/dev/null > "$N/netns.before" || true
iptables-save > "$N/iptables.before" 2>/dev/null || true
# The bridge the CNI plugin would make on the first Pod, made now with its gateway address (the plugin
# keeps an existing bridge and address); node-down.sh deletes it.
ip link show basinbr0 >/dev/null 2>&1 || ip link add basinbr0 type bridge
ip addr show dev basinbr0 | grep -q " $BRIDGE_IP/" || ip addr add "$BRIDGE_IP/${POD_CIDR#*/}" dev basinbr0
ip link set basinbr0 up
cat > "$N/containerd/config.toml" <<TOML
version = 2
root = "$N/containerd/root"
state = "$N/containerd/state"
[grpc]
  address = "$N/containerd/containerd.sock"
[ttrpc]
  address = "$N/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:local"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$(command -v runc)"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$N/cni/conf"
TOML
cat > "$N/cni/conf/10-basin.conflist" <<JSON
{"cniVersion": "0.4.0", "name": "basin-test", "plugins": [
  {"type": "bridge", "bridge": "basinbr0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "dataDir": "$N/cni/netdir", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "loopback"}]}
JSON
cat > "$N/kubelet/config.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
makeIPTablesUtilChains: false
serializeImagePulls: false
hairpinMode: hairpin-veth
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
maxPods: 50
YAML
if [ -n "${CLUSTER_DNS:-}" ]; then
  printf 'clusterDNS: ["%s"]\nclusterDomain: cluster.local\n' "$CLUSTER_DNS" >> "$N/kubelet/config.yaml"
fi
containerd --config "$N/containerd/config.toml" > "$N/containerd.log" 2>&1 & echo $! > "$N/containerd.pid"
CTR="ctr -a $N/containerd/containerd.sock -n k8s.io"
for _ in $(seq 1 100); do $CTR version >/dev/null 2>&1 && break; sleep 0.2; done
# The sandbox ("pause") image: a static binary that sleeps and reaps children, built once and cached.
if [ ! -s "$IMG/pause.tar" ]; then
  P=$(mktemp -d)
  printf '%s\n' '#include <signal.h>' '#include <unistd.h>' '#include <sys/wait.h>' \
    'static void term(int s){(void)s;_exit(0);}' 'static void reap(int s){(void)s;while(waitpid(-1,0,WNOHANG)>0);}' \
    'int main(void){struct sigaction a={0},c={0};a.sa_handler=term;sigaction(SIGINT,&a,0);sigaction(SIGTERM,&a,0);' \
    'c.sa_handler=reap;c.sa_flags=SA_NOCLDSTOP;sigaction(SIGCHLD,&c,0);for(;;)pause();}' > "$P/pause.c"
  gcc -static -O2 -o "$P/pause" "$P/pause.c"
  printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' > "$P/Containerfile"
  buildah --storage-driver vfs --root "$P/store" --runroot "$P/run" bud --isolation chroot -q -t localhost/pause:local -f "$P/Containerfile" "$P" >/dev/null
  skopeo --override-os linux copy -q "containers-storage:[vfs@$P/store+$P/run]localhost/pause:local" "docker-archive:$IMG/pause.tar:localhost/pause:local"
  rm -rf "$P"
fi
for t in "$IMG/pause.tar" "$@"; do $CTR images import "$t" >/dev/null; done
"$B/kubelet" --config="$N/kubelet/config.yaml" --kubeconfig="$KUBECONFIG" \
  --root-dir="$N/kubelet/root" --cert-dir="$N/kubelet/certs" \
  --container-runtime=remote --container-runtime-endpoint="unix://$N/containerd/containerd.sock" \
  --image-service-endpoint="unix://$N/containerd/containerd.sock" --runtime-request-timeout=5m \
  --node-ip=192.0.2.2 --register-node=true > "$N/kubelet.log" 2>&1 & echo $! > "$N/kubelet.pid"
NODE=$(hostname | tr 'A-Z' 'a-z')
for _ in $(seq 1 240); do
  [ "$(kubectl get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ] && break
  sleep 0.5
done
# start-cluster.sh runs without the node-lifecycle controller, which would lift this taint.
kubectl taint node "$NODE" node.kubernetes.io/not-ready:NoSchedule- >/dev/null 2>&1 || true
if [ "${PROXY:-0}" = 1 ]; then
  "$B/kube-proxy" --kubeconfig="$KUBECONFIG" --hostname-override="$NODE" --cluster-cidr="$POD_CIDR" --proxy-mode=iptables \
    --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0 \
    --metrics-bind-address=127.0.0.1:10249 --healthz-bind-address=127.0.0.1:10256 > "$N/kube-proxy.log" 2>&1 & echo $! > "$N/kube-proxy.pid"
fi
kubectl get node "$NODE" -o jsonpath='{.metadata.name} {.status.conditions[?(@.type=="Ready")].status}{"\n"}'
