#!/usr/bin/env bash
# Build llama.cpp for this CPU (-march=native) from the llama-cpp-python 0.3.36 source on PyPI,
# so bench/cpu_decode.py can compare our kernels with a llama.cpp that uses the same
# instruction sets (the shared wheel is AVX2-only). About 2 minutes on 2 cores: only the llama
# and ggml-cpu libraries are built.
#
#   bench/llama_native.sh [DIR]          # default DIR: ~/.cache/syshax/llama-native
#   AMX=1 bench/llama_native.sh DIR      # with ggml's AMX kernels, on a CPU that runs them
#   LLAMA_CPP_LIB_PATH=DIR python bench/cpu_decode.py
#
# llama-cpp-python itself must be installed (the wheel or PyPI): this only swaps its
# libraries. AMX is left out by default: some VMs advertise AMX without enabling its tile
# state, and ggml's AMX kernels fault there (general protection fault at ldtilecfg). AMX=1
# builds them, for a CPU where they run. On the 2-core Xeon VM of 2026-12-05 a tile program
# that asks the kernel for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM) ran, but this AMX
# build segfaulted loading the 1B Q4_0 shape (after repacking its tensors for AMX).
set -euo pipefail
VERSION=0.3.36
DEST=${1:-$HOME/.cache/syshax/llama-native}
PIP=${PIP:-$(dirname "$0")/../.venv/bin/pip}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

command -v cmake >/dev/null || { echo "llama_native.sh: cmake is needed" >&2; exit 2; }
"$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
NO_AMX=""
[ "$(uname -m)" = x86_64 ] && [ "${AMX:-0}" != 1 ] && NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
GEN=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
cmake -S "$SRC" -B "$WORK/build" -G "$GEN" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >/dev/null
cmake --build "$WORK/build" -j "$(nproc)" --target llama ggml-cpu
mkdir -p "$DEST"
cp -a "$WORK"/build/bin/*.so* "$DEST"/
# The libraries find each other next to themselves ($ORIGIN), not in the deleted build tree.
LLAMA_CPP_LIB_PATH="$DEST" "$(dirname "$PIP")/python" -c \
    'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())'
echo "built: LLAMA_CPP_LIB_PATH=$DEST python bench/cpu_decode.py"
