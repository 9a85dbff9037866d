#!/usr/bin/env bash
# llama.cpp for the tests that run GGUF exports in it (tests/unit/run/test_gguf.py,
# tests/integration/test_train.py): llama-cpp-python, the binding, and the libraries it loads
# (libllama, libggml*) built from the llama.cpp sources its release vendors.
#
#   bash scripts/llama_cpp.sh [VENV_DIR]             # every step; default .venv
#   bash scripts/llama_cpp.sh build LIB_DIR          # download and compile the libraries
#   bash scripts/llama_cpp.sh binding VENV           # the binding, without libraries
#   bash scripts/llama_cpp.sh install VENV LIB_DIR   # those libraries into the binding
#
# The package index has no wheel of llama-cpp-python, so every fresh environment compiles
# llama.cpp. `pip install llama-cpp-python` builds it whole (3 min 27 s on 2 cores here, its
# multimodal library left out), most of it llama.cpp's `common` library, which the binding does
# not load. So the binding is installed without a build (its CMake option LLAMA_BUILD=OFF) and
# the two libraries it loads are built and put where it looks for them; scripts/env.sh compiles
# them while it installs the other packages. They are compiled at -O1: 54 s here where -O3
# (CMake's Release) takes 78 s, which held up the environment by 20 s, and the tests' models
# have a few thousand parameters (the GGUF tests took 4.1 s at -O3, 4.7 s at -O1 or -O0).
# Users who want the binding install the `llamacpp` extra, which builds it the usual way.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="$(grep '^llama-cpp-python==' constraints.txt | cut -d= -f3)"

build() {
    local out="$1" work
    work="$(mktemp -d)"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    # shellcheck disable=SC2016  # $ORIGIN is the loader's, not the shell's
    cmake -S "$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)" -B "$work/build" \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS_RELEASE="-O1 -DNDEBUG" \
        -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' > "$work/cmake.log"
    # The compiler's warnings too: pages of them, worth reading only if the build fails.
    cmake --build "$work/build" --target llama -j "$(nproc)" > "$work/build.log" 2>&1 \
        || { tail -n 40 "$work/build.log" >&2; return 1; }
    mkdir -p "$out"
    cp -P "$work"/build/bin/lib*.so* "$out"/
    rm -rf "$work"
}

binding() {
    # No cache: the wheel built without libraries must not stand in for a whole one later.
    CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$1/bin/uv" pip install --quiet --no-cache \
        --python "$1/bin/python" -c constraints.txt "llama-cpp-python==$VERSION"
}

install() {
    local venv="$1" libs="$2" py="$1/bin/python" target
    target="$("$py" -c "import importlib.util, pathlib
print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')")"
    mkdir -p "$target"
    cp -P "$libs"/lib*.so* "$target"/
    "$py" -c "import llama_cpp; print(f'llama.cpp: ready (llama-cpp-python {llama_cpp.__version__})')"
}

case "${1:-}" in
    build) build "$2" ;;
    binding) binding "$2" ;;
    install) install "$2" "$3" ;;
    *)
        VENV="${1:-.venv}"
        if "$VENV/bin/python" -c "import llama_cpp" 2> /dev/null; then
            exit 0
        fi
        LIBS="$(mktemp -d)"
        trap 'rm -rf "$LIBS"' EXIT
        build "$LIBS"
        binding "$VENV"
        install "$VENV" "$LIBS"
        ;;
esac
