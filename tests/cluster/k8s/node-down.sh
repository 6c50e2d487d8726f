#!/bin/bash
# Removes the node that node-up.sh added: deletes Pods first (so CNI releases their namespaces), then
# stops kube-proxy, kubelet and containerd by pid, and restores what they changed on the host
# (network namespaces, bridge, iptables chains, mounts, cgroup folders, sysctls).
# Usage: D=<cluster dir> [N=<node dir>] bash node-down.sh   (then stop-cluster.sh)
# A copy of the verified recipe in the project's shared k8s/node-down.sh. Stop whatever recreates Pods
# (the operator) first: this deletes the workload objects, then the Pods.
B=${B:-${XDG_CACHE_HOME:-$HOME/.cache}/basin-k8s/bin}
D=${D:?set D to the folder start-cluster.sh used}; N=${N:-$D/node}
export KUBECONFIG=$D/kubeconfig
kubectl() { "${KUBECTL:-$B/kubectl}" "$@"; }
CTR="ctr -a $N/containerd/containerd.sock -n k8s.io"
kubectl delete deployments,statefulsets,jobs,daemonsets --all --all-namespaces --wait=true --timeout=30s >/dev/null 2>&1
kubectl delete pods --all --all-namespaces --grace-period=1 --wait=true --timeout=60s >/dev/null 2>&1
for _ in $(seq 1 60); do [ -z "$(kubectl get pods -A -o name 2>/dev/null)" ] && break; sleep 0.5; done
stop() { [ -f "$1" ] || return 0; kill "$(cat "$1")" 2>/dev/null; for _ in $(seq 1 40); do ps -p "$(cat "$1")" >/dev/null || break; sleep 0.25; done; rm -f "$1"; }
if [ -f "$N/kube-proxy.pid" ]; then
  stop "$N/kube-proxy.pid"; "$B/kube-proxy" --cleanup >/dev/null 2>&1
  for t in filter nat mangle; do iptables -t $t -F KUBE-PROXY-CANARY 2>/dev/null; iptables -t $t -X KUBE-PROXY-CANARY 2>/dev/null; done
  for c in KUBE-MARK-MASQ KUBE-MARK-DROP; do iptables -t nat -F $c 2>/dev/null; iptables -t nat -X $c 2>/dev/null; done
  grep -q '^\*mangle' "$N/iptables.before" 2>/dev/null || nft delete table ip mangle 2>/dev/null
fi
stop "$N/kubelet.pid"
for t in $($CTR tasks ls -q 2>/dev/null); do $CTR tasks kill -s KILL "$t" 2>/dev/null; done; sleep 1
for t in $($CTR tasks ls -q 2>/dev/null); do $CTR tasks rm -f "$t" >/dev/null 2>&1; done
for c in $($CTR containers ls -q 2>/dev/null); do $CTR containers rm "$c" >/dev/null 2>&1; done
stop "$N/containerd.pid"
for n in $(ls /var/run/netns 2>/dev/null | grep '^cni-'); do grep -qx "$n" "$N/netns.before" 2>/dev/null || ip netns del "$n"; done
grep " $N/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l
ip link del basinbr0 2>/dev/null
for h in /sys/fs/cgroup/*/; do [ -d "$h/k8s.io" ] && rmdir "$h"/k8s.io/* "$h/k8s.io" 2>/dev/null; done
while IFS== read -r k v; do [ -n "$v" ] && [ "$(cat /proc/sys/$k)" != "$v" ] && echo "$v" > "/proc/sys/$k"; done < "$N/sysctl.orig"
echo "node removed"
