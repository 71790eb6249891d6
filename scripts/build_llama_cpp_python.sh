#!/usr/bin/env bash
# Build llama-cpp-python from its sdist with fastrun-cpp's llama.cpp patches
# (patches/llama.cpp/*.patch, in order) and install it into PYTHON's environment.
#
#   CMAKE_ARGS="..." scripts/build_llama_cpp_python.sh PYTHON VERSION
#
# Used by `make setup` (CMAKE_ARGS from fastrun_cpp/cpu.py) and the Containerfile.
set -euo pipefail
python=$1
version=$2
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
source="$work/llama_cpp_python-$version"
for patch_file in "$root"/patches/llama.cpp/*.patch; do
    patch -d "$source" -p1 --forward --quiet < "$patch_file"
done
# --no-cache-dir keeps pip from reusing a wheel built with other flags or patches;
# --force-reinstall rebuilds over a copy already installed.
"$python" -m pip install --no-cache-dir --force-reinstall --no-deps "$source"
