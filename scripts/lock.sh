#!/usr/bin/env bash
# Rewrite constraints.txt: every package raylm and all its extras need, at the versions the
# current constraints.txt already fixes where they still fit pyproject.toml's ranges, others
# at the newest that fit. Run the whole suite after.
#
#   bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
UV="${UV:-.venv/bin/uv}"
body="$(mktemp)"
"$UV" pip compile pyproject.toml --all-extras --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --no-header --no-annotate --quiet \
    -c <(grep -v '^#' constraints.txt 2>/dev/null || true) -o "$body"
{
  cat <<'HEAD'
# The versions CI, cluster/Dockerfile and the cluster files install: every package raylm and
# all its extras need, resolved for CPython 3.11 on x86-64 Linux by scripts/lock.sh.
# pyproject.toml gives the ranges raylm supports; this file is the set that was tested. Used
# as a constraint (pip/uv `-c constraints.txt`): it fixes versions without installing
# anything by itself, so the CUDA packages below cost nothing where torch's CPU build is
# installed.
HEAD
  cat "$body"
} > constraints.txt
rm -f "$body"
echo "lock: $(grep -c '==' constraints.txt) packages in constraints.txt"
