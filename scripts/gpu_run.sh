#!/usr/bin/env bash
# Run raylm commands on a machine without network, from the wheel set of scripts/gpu_wheels.py.
#
#   bash scripts/gpu_run.sh OUT_DIR 'raylm train --config jobs/configs/gpu_1b_one.yaml' ['CMD' ...]
#
# Installs the set (.whl/, or RAYLM_WHEELS) into /tmp/site (or RAYLM_SITE) without dependency
# resolution: the image's torch, transformers, peft, pyarrow ... are the ones tested there.
# Starts one Ray head on this machine's cores and GPUs without the dashboard, with token
# authentication (this user's ~/.ray/auth_token, made if missing), runs each command
# in turn through bash (each one's output in OUT_DIR/NAME.log, NAME its position: 1.log, 2.log
# ...), and always stops Ray and packs its logs into OUT_DIR/ray-logs.tgz. Exits with the first
# failing command's status, after running the rest.
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/gpu_run.sh OUT_DIR 'COMMAND' ['COMMAND' ...]" >&2
    exit 2
fi
OUT=$1
shift
cd "$(dirname "$0")/.."
WHEELS=${RAYLM_WHEELS:-.whl}
SITE=${RAYLM_SITE:-/tmp/site}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "gpu_run: no wheels in $WHEELS: build them with python scripts/gpu_wheels.py" >&2
    exit 2
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || exit
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
# Where the GPUs are, Ray sees them itself; nvidia-smi -L counts them for the log line.
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "gpu_run: $(nproc) CPUs, ${GPUS:-0} GPUs; torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), ray $("$PYTHON" -c 'import ray; print(ray.__version__)')"
stop_ray() {
    ray stop --force > /dev/null 2>&1
    tar czf "$OUT/ray-logs.tgz" -C /tmp/ray/session_latest logs 2> /dev/null
}
trap stop_ray EXIT
# Token authentication on, as Ray ships it: the head and every command here use this user's
# token. Without RAY_AUTH_MODE=token set on both sides, a head that found ~/.ray/auth_token
# turned authentication on and its clients, not looking for the token, were refused.
export RAY_AUTH_MODE=token
if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "$HOME/.ray/auth_token" ]; then
    ray get-auth-token --generate > /dev/null || exit
fi
ray start --head --disable-usage-stats --include-dashboard=false --num-cpus="$(nproc)" \
    > "$OUT/ray-start.log" 2>&1 || { cat "$OUT/ray-start.log"; exit 1; }
# Every command joins this head (raylm's run.ray_address, unset, reads RAY_ADDRESS).
export RAY_ADDRESS=auto
status=0
n=0
for cmd in "$@"; do
    n=$((n + 1))
    echo "gpu_run: [$n] $cmd"
    start=$(date +%s)
    bash -c "$cmd" > "$OUT/$n.log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$n.log"
    echo "gpu_run: [$n] exit $rc after $(( $(date +%s) - start )) s"
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
done
exit $status
