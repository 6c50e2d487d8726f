#!/bin/bash
# Stops what start-cluster.sh started in $D, by pid, and waits (up to 15 s) for each to exit.
D=${D:?set D to the folder start-cluster.sh used}
for p in kcm apiserver etcd; do [ -f "$D/$p.pid" ] && kill "$(cat "$D/$p.pid")" 2>/dev/null; done
for p in kcm apiserver etcd; do
  [ -f "$D/$p.pid" ] || continue
  for _ in $(seq 1 30); do ps -p "$(cat "$D/$p.pid")" >/dev/null || break; sleep 0.5; done
  ps -p "$(cat "$D/$p.pid")" >/dev/null && echo "$p still running" || echo "$p stopped"
done
