#!/usr/bin/env bash
# The speed matrix on a GPU machine that can download nothing (the device tool's): one CUDA build
# of the patched llama.cpp serves both fastrun-cpp (its Python bindings) and llama-server, then
# bench/matrix.py runs prefill, and decode and sampled decode at c=1/8/32/64, both fully offloaded,
# without speculation on either side and with it on both (llama-server --spec-type ngram-mod).
#
# Carried in (made here by bench/gpu_prepare.sh): .whl/ (fastrun-cpp's dependencies as wheels),
# .gpu/src.tar.gz (the llama-cpp-python sdist's Python package and vendored llama.cpp, patched,
# without its models and docs) and .bench/tiny.gguf (SmolLM2's tokenizer and template). No real model fits what can be carried, so
# the model is SmolLM2-135M's shape with random f16 weights (fastrun_cpp/tiny_model.py).
#
#   bash bench/gpu_matrix.sh OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.bench}
export PATH="$PATH:/usr/local/cuda/bin"
started=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvcc --version | tail -1 || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
mkdir -p /tmp/gpu-build && tar xzf .gpu/src.tar.gz -C /tmp/gpu-build
source=/tmp/gpu-build/llama_cpp_python-$(scripts/llama_cpp_source.sh version)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# shellcheck disable=SC2046
cmake -S "$source/vendor/llama.cpp" -B /tmp/gpu-build/build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    $(python3 -m fastrun_cpp.cpu cmake-args) >"$out/cmake.log" 2>&1
cmake --build /tmp/gpu-build/build --target llama-server llama -j "$(nproc)" >"$out/build.log" 2>&1
echo "built in $((SECONDS - started)) s"
mkdir -p .bench
cp /tmp/gpu-build/build/bin/llama-server .bench/llama-server
cp -r "$source/llama_cpp" /tmp/site/llama_cpp
mkdir -p /tmp/site/llama_cpp/lib
cp -a /tmp/gpu-build/build/bin/*.so* /tmp/site/llama_cpp/lib/
python3 -c "import llama_cpp.llama_cpp as l; assert l.llama_supports_gpu_offload(), 'no GPU backend'"
python3 -m fastrun_cpp.tiny_model /tmp/random-smollm2.gguf --like .bench/tiny.gguf --shape smollm2-135m --f16
# Each cell's line is written as it is measured, so a run cut short still brings back its cells.
timeout "${MATRIX_TIMEOUT:-280}" python3 bench/matrix.py --rounds 1 --models random-smollm2=/tmp/random-smollm2.gguf \
    --cells prefill,decode,sampled --decode-levels 1,8,32,64 --slots 64 --llama-server-args "-ngl 999" \
    --json "$out/gpu-matrix.json" 2>&1 | grep --line-buffered -v "^INFO" | tee "$out/matrix.log" || true
tar czf "$out/server-logs.tar.gz" .bench/*.log 2>/dev/null || true
echo "done in $((SECONDS - started)) s"
