#!/usr/bin/env bash
# Build llama.cpp's llama-server for this CPU (-march=native) from the llama-cpp-python 0.3.36
# source on PyPI (the same llama.cpp as bench/llama_native.sh), for
# `bench/serve.py --against llama-server`. One static binary (ggml and llama linked in; only
# libc, libstdc++ and libgomp from the system), with llama-perplexity and llama-quantize beside
# it. About 10-15 minutes on 2 cores.
#
#   bench/llama_server.sh [--force] [DIR]     # default DIR: ~/.cache/syshax/llama-server
#   python bench/serve.py --launch native --against llama-server --llama-server DIR/llama-server
#
# An existing DIR/llama-server is kept unless --force. The web UI is left out (its assets would
# be downloaded from Hugging Face) and so is HTTPS. AMX is left out as in llama_native.sh: VMs
# that advertise AMX without enabling its tile state make ggml's AMX kernels fault.
set -euo pipefail
VERSION=0.3.36
FORCE=0
[ "${1:-}" = --force ] && { FORCE=1; shift; }
DEST=${1:-$HOME/.cache/syshax/llama-server}
PIP=${PIP:-$(dirname "$0")/../.venv/bin/pip}

if [ -x "$DEST/llama-server" ] && [ "$FORCE" = 0 ]; then
    echo "llama_server.sh: $DEST/llama-server exists (--force rebuilds it)"
    "$DEST/llama-server" --version
    exit 0
fi
command -v cmake >/dev/null || { echo "llama_server.sh: cmake is needed" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
NO_AMX=""
[ "$(uname -m)" = x86_64 ] && NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
GEN=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
# LLAMA_CURL is deprecated (ignored) in this llama.cpp; it is passed for older sources.
cmake -S "$SRC" -B "$WORK/build" -G "$GEN" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" >/dev/null
# llama-perplexity and llama-quantize come along (they share the libraries built for the
# server): bench/perplexity.py measures llama.cpp's KL divergence on files llama-quantize makes.
cmake --build "$WORK/build" -j "$(nproc)" --target llama-server llama-perplexity llama-quantize
mkdir -p "$DEST"
for tool in llama-perplexity llama-quantize llama-server; do
    cp "$WORK/build/bin/$tool" "$DEST/$tool.tmp"
    mv "$DEST/$tool.tmp" "$DEST/$tool"
done
"$DEST/llama-server" --version
echo "built: python bench/serve.py --launch native --against llama-server --llama-server $DEST/llama-server"
