#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` from the llama.cpp sources vendored in the
# llama-cpp-python sdist we depend on, as users build it: llama.cpp's default options (native
# CPU, llamafile's tinyBLAS on), none of ours, no patches. The baseline of side-by-side benchmarks.
# Output: .bench/llama-server, and from the same build llama-bench (bare llama.cpp's decode speed)
# and llama-quantize (bench models of real shapes); ignored by git. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(scripts/llama_cpp_source.sh version)
work=.bench/llama.cpp-$version
binary=.bench/llama-server
tools=(llama-server llama-bench llama-quantize)
if [[ -x $binary && -x .bench/llama-bench && -x .bench/llama-quantize && -f $work/.built-defaults ]]; then
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
# On a CPU with AMX, -march=native compiles llama.cpp's AMX kernels in, and they crash
# (SIGSEGV in ggml_backend_amx_mul_mat, at the first decode; seen on Sapphire Rapids VMs): the
# default build does not run at all there. The baseline is then the default build without
# them (their macros undefined after -march=native defines them), all else native, as a user would
# have to build it there (fastrun_cpp/cpu.py leaves AMX off too).
no_amx=()
if grep -qw amx_tile /proc/cpuinfo; then
    no_amx=("-DCMAKE_C_FLAGS=-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
            "-DCMAKE_CXX_FLAGS=-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__")
fi
# An interrupted build of these options goes on where it stopped (it takes a while on 2 cores).
cmake -S "$work" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON "${no_amx[@]}"
cmake --build "$work/build" --target "${tools[@]}" -j "$(nproc)"
for tool in "${tools[@]}"; do
    cp "$work/build/bin/$tool" ".bench/$tool"
done
touch "$work/.built-defaults"
echo "built ${tools[*]/#/.bench/}"
