#!/usr/bin/env bash
# Create (if missing) and fill the project's virtual environment.
#
#   bash scripts/env.sh [VENV_DIR]      # default .venv
#
# torch is installed first and pinned to the CPU build 2.13.0, so the resolver never pulls a
# multi-GB CUDA build onto a machine without a GPU. On a GPU machine set RAYLM_TORCH to the
# install arguments of the CUDA build you want, and add the gpu extra (NVML: energy and GPU
# metrics), e.g.
#   RAYLM_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130" \
#       RAYLM_EXTRAS=dev,gpu bash scripts/env.sh
# RAYLM_EXTRAS (default dev) names the extras of pyproject.toml to install with raylm; set
# and empty, raylm alone (what `make demo` runs on).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "env: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"
UV=("$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python")
"$PIP" install --quiet --disable-pip-version-check uv
EXTRAS="${RAYLM_EXTRAS-dev}"
# llama.cpp, which the tests run GGUF exports in: its libraries compile (54 s alone here,
# scripts/llama_cpp.sh says why) while the packages below download, once per environment.
LLAMA_LIBS=""
if [[ ",$EXTRAS," == *",dev,"* ]] && ! "$VENV/bin/python" -c "import llama_cpp" 2> /dev/null
then
    LLAMA_LIBS="$(mktemp -d)"
    bash scripts/llama_cpp.sh build "$LLAMA_LIBS" > "$LLAMA_LIBS.log" 2>&1 &
    LLAMA_BUILD=$!
fi
# torch first, through uv: it unpacks and compiles the CPU wheel in 10 s where pip takes 28 s
# here. uv does not read pip's PIP_FIND_LINKS (where this machine keeps its wheels), so it is
# passed on.
# shellcheck disable=SC2086
"${UV[@]}" ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} -c constraints.txt \
    ${RAYLM_TORCH:-torch==2.13.0} \
    || "$PIP" install --quiet --disable-pip-version-check -c constraints.txt \
        ${RAYLM_TORCH:-torch==2.13.0}
# The rest through uv too: the same versions as pip resolves, in 56 s instead of 104 s here
# (parallel downloads); the torch installed above satisfies raylm's floor, so it stays. The
# bytecode is compiled now, as pip does: where PYTHONDONTWRITEBYTECODE is set (CI here) every
# process would otherwise compile what it imports (4 s more for each Ray worker, which halved
# the suite's speed). pip remains the fallback where uv cannot reach its index.
# Every version as constraints.txt fixes it (the set CI tests; scripts/lock.sh writes it).
TARGET=".${EXTRAS:+[$EXTRAS]}"
"${UV[@]}" -c constraints.txt -e "$TARGET" \
    || "$PIP" install --quiet --disable-pip-version-check -c constraints.txt -e "$TARGET"
if [ -n "$LLAMA_LIBS" ]; then
    bash scripts/llama_cpp.sh binding "$VENV"  # 7 s of its own, while the libraries compile
    if ! wait "$LLAMA_BUILD"; then
        cat "$LLAMA_LIBS.log" >&2
        echo "env: compiling llama.cpp failed (it needs cmake and a C++ compiler)" >&2
        exit 1
    fi
    bash scripts/llama_cpp.sh install "$VENV" "$LLAMA_LIBS"
    rm -rf "$LLAMA_LIBS" "$LLAMA_LIBS.log"
fi
# raylm's own modules too (an editable install is not compiled): every Ray worker, driver and
# notebook kernel imports them, 0.3 s of compiling each where bytecode cannot be written.
"$VENV/bin/python" -m compileall -q raylm > /dev/null
"$VENV/bin/python" -c "import torch, ray, raylm; print(f'env: ready (torch {torch.__version__}, ray {ray.__version__})')"
