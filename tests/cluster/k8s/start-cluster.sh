#!/bin/bash
# Starts etcd + kube-apiserver (RBAC, token auth) + kube-controller-manager on 127.0.0.1: no Docker, no
# kubelet; no scheduler unless SCHED_PORT is set (a cluster that node-up.sh adds a node to needs one, or
# its Pods stay Pending). Adapted from shared/k8s/start-cluster.sh with the ports as parameters so several
# clusters (or other users of 6443) can coexist.
# Usage: D=<empty folder> API_PORT=.. ETCD_PORT=.. PEER_PORT=.. KCM_PORT=.. [SCHED_PORT=..] bash start-cluster.sh
# Prints the admin kubeconfig path last; stop with D=<folder> bash stop-cluster.sh.
set -euo pipefail
B=${B:-${XDG_CACHE_HOME:-$HOME/.cache}/basin-k8s/bin}
D=${D:-$(mktemp -d)/cluster}
API_PORT=${API_PORT:-6443}; ETCD_PORT=${ETCD_PORT:-2379}; PEER_PORT=${PEER_PORT:-2380}; KCM_PORT=${KCM_PORT:-10257}
rm -rf "$D" && mkdir -p "$D/pki" "$D/etcd"
cd "$D"
openssl genrsa -out pki/sa.key 2048 2>/dev/null
openssl rsa -in pki/sa.key -pubout -out pki/sa.pub 2>/dev/null
openssl req -x509 -newkey rsa:2048 -nodes -keyout pki/ca.key -out pki/ca.crt -days 2 -subj /CN=test-ca 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout pki/apiserver.key -out pki/apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.0.0.1\n' > pki/ext.cnf
openssl x509 -req -in pki/apiserver.csr -CA pki/ca.crt -CAkey pki/ca.key -CAcreateserial -out pki/apiserver.crt -days 2 -extfile pki/ext.cnf 2>/dev/null
TOKEN=$(openssl rand -hex 16)
echo "$TOKEN,admin,admin,system:masters" > pki/tokens.csv
etcd --data-dir "$D/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
     --listen-peer-urls "http://127.0.0.1:$PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
     --initial-cluster "default=http://127.0.0.1:$PEER_PORT" > "$D/etcd.log" 2>&1 & echo $! > "$D/etcd.pid"
"$B/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" --bind-address=127.0.0.1 --advertise-address=127.0.0.1 \
  --secure-port="$API_PORT" --tls-cert-file=pki/apiserver.crt --tls-private-key-file=pki/apiserver.key --client-ca-file=pki/ca.crt \
  --token-auth-file=pki/tokens.csv --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file=pki/sa.pub --service-account-signing-key-file=pki/sa.key \
  --service-cluster-ip-range=10.0.0.0/24 --endpoint-reconciler-type=none > "$D/apiserver.log" 2>&1 & echo $! > "$D/apiserver.pid"
cat > "$D/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters: [{name: local, cluster: {server: https://127.0.0.1:$API_PORT, certificate-authority: $D/pki/ca.crt}}]
users: [{name: admin, user: {token: $TOKEN}}]
contexts: [{name: local, context: {cluster: local, user: admin, namespace: default}}]
current-context: local
KC
ok=""
for i in $(seq 1 120); do
  curl -sk --max-time 1 -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$API_PORT/readyz" >/dev/null 2>&1 && { ok=1; break; }
  sleep 0.5
done
[ -n "$ok" ] || { echo "apiserver not ready after 60 s; see $D/apiserver.log" >&2; exit 1; }
echo "apiserver ready after ~$((i/2))s" >&2
"$B/kube-controller-manager" --kubeconfig="$D/kubeconfig" --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --port=0 --leader-elect=false \
  --service-account-private-key-file=pki/sa.key --root-ca-file=pki/ca.crt --use-service-account-credentials=true \
  --controllers='*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service' > "$D/kcm.log" 2>&1 & echo $! > "$D/kcm.pid"
# The token controller stays on: Kubernetes 1.20's ServiceAccount admission refuses a Pod that mounts its
# token (the router's) until a token Secret exists. The tests ask the TokenRequest API first, as on >= 1.24.
# --port=0: no insecure port (its fixed 10252 would collide with another cluster on this machine).
ok=""
for i in $(seq 1 120); do
  curl -sk --max-time 1 "https://127.0.0.1:$KCM_PORT/healthz" >/dev/null 2>&1 && { ok=1; break; }
  ps -p "$(cat "$D/kcm.pid")" >/dev/null || break
  sleep 0.5
done
[ -n "$ok" ] || { echo "controller-manager not healthy; see $D/kcm.log:" >&2; tail -3 "$D/kcm.log" >&2; exit 1; }
if [ -n "${SCHED_PORT:-}" ]; then  # --port=0: no insecure port (a fixed 10251)
  "$B/kube-scheduler" --kubeconfig="$D/kubeconfig" --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --port=0 \
    --leader-elect=false > "$D/sched.log" 2>&1 & echo $! > "$D/sched.pid"
fi
echo "$D/kubeconfig"
