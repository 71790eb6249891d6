#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` from the llama.cpp sources vendored in the
# llama-cpp-python sdist we depend on, as users build it: llama.cpp's default options (native
# CPU, llamafile's tinyBLAS on), none of ours, no patches. The baseline of side-by-side benchmarks.
# Output: .bench/llama-server (ignored by git). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(scripts/llama_cpp_source.sh version)
work=.bench/llama.cpp-$version
binary=.bench/llama-server
if [[ -x $binary && -f $work/.built-defaults ]]; then
    echo "$binary is up to date"
    exit 0
fi
mkdir -p .bench
if [[ ! -d $work/src ]]; then
    source=$(scripts/llama_cpp_source.sh unpack .bench/sdist --unpatched)
    rm -rf "$work"
    mv "$source/vendor/llama.cpp" "$work"
    rm -rf "$source"
fi
if [[ -f $work/.built ]]; then  # a build with other options (this script once passed ours)
    rm -rf "$work/build" "$work/.built"
fi
# An interrupted build of these options goes on where it stopped (it takes a while on 2 cores).
cmake -S "$work" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$work/build" --target llama-server -j "$(nproc)"
cp "$work/build/bin/llama-server" "$binary"
touch "$work/.built-defaults"
echo "built $binary"
