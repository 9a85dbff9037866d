#!/usr/bin/env bash
# Start (or stop) a single-node Ray cluster on this machine, reachable only on loopback, for
# trying `ray job submit` before a real cluster:
#
#   bash cluster/local.sh start      # head on 127.0.0.1, dashboard/job API on :8265
#   export RAY_AUTH_MODE=token
#   ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
#       python jobs/prepare.py --config jobs/configs/cpu_tiny.yaml --output /tmp/prepared
#   bash cluster/local.sh stop
#
# Token authentication is on: the head is started with RAY_AUTH_MODE=token and a token
# generated once for this user (~/.ray/auth_token, readable by this user only), whatever the
# caller's environment says. `ray job submit` on this machine needs the same mode
# (export RAY_AUTH_MODE=token; it finds the token file); elsewhere, export RAY_AUTH_TOKEN too.
set -euo pipefail
case "${1:-start}" in
  start)
    export RAY_AUTH_MODE=token
    if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "$HOME/.ray/auth_token" ]; then
      (umask 077; ray get-auth-token --generate > /dev/null)
    fi
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
