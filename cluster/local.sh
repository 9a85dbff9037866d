#!/usr/bin/env bash
# Start (or stop) a single-node Ray cluster on this machine, reachable only on loopback, for
# trying `ray job submit` before a real cluster:
#
#   bash cluster/local.sh start      # head on 127.0.0.1, dashboard/job API on :8265
#   ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
#       python jobs/prepare.py --config jobs/configs/cpu_tiny.yaml --output /tmp/prepared
#   bash cluster/local.sh stop
#
# Token authentication stays on (Ray's default for new clusters): `ray job submit` on the same
# machine finds the token Ray wrote for this user; elsewhere, export RAY_AUTH_TOKEN.
set -euo pipefail
case "${1:-start}" in
  start)
    ray start --head --node-ip-address=127.0.0.1 --port=6379 \
        --dashboard-host=127.0.0.1 --dashboard-port=8265 --disable-usage-stats
    ;;
  stop)
    ray stop
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
