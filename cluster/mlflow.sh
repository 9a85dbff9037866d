#!/usr/bin/env bash
# The cluster's MLflow tracking server, as every cluster file starts it: MLflow's basic-auth
# app (every request needs a user and password), answering only to the host names the
# cluster's processes use, with one server process as the only writer of its store.
#
#   MLFLOW_AUTH_ADMIN_USERNAME=... MLFLOW_AUTH_ADMIN_PASSWORD=... \
#   MLFLOW_TRACKING_USERNAME=... MLFLOW_TRACKING_PASSWORD=... \
#   MLFLOW_ALLOWED_HOSTS=raylm-mlflow:5000 \
#     bash cluster/mlflow.sh --host 0.0.0.0 --port 5000 \
#       --store sqlite:////var/lib/mlflow/mlflow.db --artifacts s3://BUCKET/mlflow
#
# The credentials come from the environment (a Kubernetes Secret, or the node's env files the
# launcher files write), never from a file in this project. Two accounts: the admin
# (MLFLOW_AUTH_ADMIN_*), which manages users and exists only in this server's environment,
# created the first time the server starts on an empty user store; and the tracking user
# (MLFLOW_TRACKING_*), what MLflow's client sends from the driver, the Train controller and
# the workers, created (or its password set) here at every start as an ordinary user. With
# NO_PERMISSIONS as the default, the tracking user reads and writes the experiments and models
# it creates (MLflow gives their creator MANAGE) and nothing else, and manages no users.
#
# MLFLOW_ALLOWED_HOSTS: the Host headers the server answers to, comma-separated, each with
# its port, `*` allowed inside a name (MLflow refuses any other with 403, which stops a
# browser on a rebound DNS name from reaching it). Loopback on this port is always added.
#
# --store: where runs live. SQLite takes one writer: this script runs one server process
# (--workers 1), and the Kubernetes file one pod replaced by Recreate, so two never write at
# once. Several servers, or high load, need a database server:
# --store postgresql://USER@HOST:5432/mlflow, its password in PGPASSWORD (from a Secret too).
# The user accounts live beside the runs (--auth-store, by default the same kind of URI with
# the database named mlflow_auth: a second SQLite file in the same directory).
set -euo pipefail

host=127.0.0.1 port=5000 store="" artifacts="" auth_store=""
while [ $# -gt 0 ]; do
  case "$1" in
    --host) host="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --store) store="$2"; shift 2 ;;
    --artifacts) artifacts="$2"; shift 2 ;;
    --auth-store) auth_store="$2"; shift 2 ;;
    *) echo "mlflow.sh: unknown argument $1 (see the top of $0)" >&2; exit 2 ;;
  esac
done
fail() { echo "mlflow.sh: $*" >&2; exit 2; }
[ -n "$store" ] || fail "--store is required (e.g. sqlite:////var/lib/mlflow/mlflow.db)"
[ -n "$artifacts" ] || fail "--artifacts is required (e.g. s3://BUCKET/mlflow)"
[ -n "${MLFLOW_TRACKING_USERNAME:-}" ] && [ -n "${MLFLOW_TRACKING_PASSWORD:-}" ] \
  || fail "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD must be set (the server's \
admin account; the cluster files read them from a Secret or the node's env file)"
[ "${#MLFLOW_TRACKING_PASSWORD}" -ge 12 ] \
  || fail "MLFLOW_TRACKING_PASSWORD is shorter than 12 characters (try: openssl rand -hex 16)"
[ -n "${MLFLOW_AUTH_ADMIN_USERNAME:-}" ] && [ -n "${MLFLOW_AUTH_ADMIN_PASSWORD:-}" ] \
  || fail "MLFLOW_AUTH_ADMIN_USERNAME and MLFLOW_AUTH_ADMIN_PASSWORD must be set (the server's \
admin account, which manages users: only the server's own environment holds it)"
[ "$MLFLOW_AUTH_ADMIN_USERNAME" != "$MLFLOW_TRACKING_USERNAME" ] \
  || fail "MLFLOW_TRACKING_USERNAME is the admin's name: the runs' account must be another, \
ordinary user (every Ray process holds it)"
[ "${#MLFLOW_AUTH_ADMIN_PASSWORD}" -ge 12 ] \
  || fail "MLFLOW_AUTH_ADMIN_PASSWORD is shorter than 12 characters (try: openssl rand -hex 16)"
[ -n "${MLFLOW_ALLOWED_HOSTS:-}" ] \
  || fail "MLFLOW_ALLOWED_HOSTS must name the host:port the cluster reaches the server by \
(e.g. raylm-mlflow:5000, or 10.*:5000 for a private network)"
case ",$MLFLOW_ALLOWED_HOSTS," in
  *",*,"*) fail "MLFLOW_ALLOWED_HOSTS=* would answer any Host header: name the hosts" ;;
esac

if [ -z "$auth_store" ]; then
  case "$store" in
    sqlite:///*) auth_store="sqlite:///$(dirname "${store#sqlite:///}")/mlflow_auth.db" ;;
    *) auth_store="${store%/*}/mlflow_auth" ;;
  esac
fi

# The auth app's settings: new users get no permissions until granted, and the admin account
# comes from the environment (MLflow reads MLFLOW_AUTH_ADMIN_* before its config file).
conf="$(mktemp -d)/basic_auth.ini"
cat > "$conf" <<EOF
[mlflow]
default_permission = NO_PERMISSIONS
database_uri = $auth_store
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
EOF
export MLFLOW_AUTH_CONFIG_PATH="$conf" MLFLOW_AUTH_ADMIN_USERNAME MLFLOW_AUTH_ADMIN_PASSWORD

# The tracking user, through MLflow's own user store: an ordinary user, its password the
# environment's (a rotated Secret takes effect at the next start).
python3 - "$auth_store" <<'PY'
import os
import sys

from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

users = SqlAlchemyStore()
users.init_db(sys.argv[1])
name, password = os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
if users.has_user(name):
    users.update_user(name, password=password, is_admin=False)
else:
    users.create_user(name, password, is_admin=False)
PY
# Signs the web UI's forms; one process, so a key of its own each start is enough.
if [ -z "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ]; then
  MLFLOW_FLASK_SERVER_SECRET_KEY="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
  export MLFLOW_FLASK_SERVER_SECRET_KEY
fi

exec mlflow server --app-name basic-auth --host "$host" --port "$port" --workers 1 \
  --allowed-hosts "$MLFLOW_ALLOWED_HOSTS,localhost:$port,127.0.0.1:$port" \
  --backend-store-uri "$store" --artifacts-destination "$artifacts"
