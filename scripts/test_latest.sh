#!/usr/bin/env bash
# The fast tier (unit and distributed tests, no Ray cluster) on the newest releases that
# pyproject.toml admits, where CI runs on constraints.txt's pins: what `pip install raylm`
# gives a user today, tried before a range is widened or the lock moves.
#
#   bash scripts/test_latest.sh [VENV_DIR] [PYTEST_ARGS...]    # default .venv-latest
#   make test-latest
#
# Everything comes from the package index as published: torch's Linux wheel there is the CUDA
# build, which runs on a CPU (the GPU tests skip). llama.cpp's libraries are built as
# scripts/env.sh builds them. The versions that matter are printed before the tests run, and
# RAYLM_LATEST=1 tells tests/unit/test_dependencies.py that this environment is not the lock's
# (it checks the ranges instead of the pins). The numerics gate holds as it is: its recorded
# losses must come out again on a new release too, or the release changed the numerics.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-latest}"
shift || true
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "latest: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check uv
# --upgrade: the newest inside the ranges each time, not what an earlier run left here.
"$VENV/bin/uv" pip install --quiet --compile-bytecode --upgrade --python "$VENV/bin/python" \
    -e ".[dev]"
bash scripts/llama_cpp.sh "$VENV"
"$VENV/bin/python" -m compileall -q raylm > /dev/null
"$VENV/bin/python" -c "
from importlib.metadata import version
names = 'torch ray transformers peft torchao mlflow datasets tokenizers pyarrow numpy'.split()
print('latest: ' + ', '.join(f'{n} {version(n)}' for n in names))"
RAYLM_LATEST=1 "$VENV/bin/python" -m pytest -q --durations=10 tests/unit tests/distributed tests/security "$@"
