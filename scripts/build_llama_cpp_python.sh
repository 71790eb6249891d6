#!/usr/bin/env bash
# Build llama-cpp-python from its pinned sdist with fastrun-cpp's llama.cpp patches
# (scripts/llama_cpp_source.sh) and install it into PYTHON's environment.
#
#   CMAKE_ARGS="..." scripts/build_llama_cpp_python.sh PYTHON [WHEEL_DIR]
#
# Used by `make setup` (CMAKE_ARGS from fastrun_cpp/cpu.py), the Containerfile and bench/gpu_check.sh.
# The build takes its tools from PYTHON's environment (no isolated one: the locked
# requirements/build.txt, not whatever scikit-build-core is newest that day). With WHEEL_DIR the
# wheel is kept there, and a wheel already there is installed without building: the caller
# keys that folder on the version, the options and the patches (the Makefile's LLAMA_KEY).
set -euo pipefail
python=$1
root=$(cd "$(dirname "$0")/.." && pwd)
version=$("$root/scripts/llama_cpp_source.sh" version)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheels=${2:-$work/wheels}
if ! compgen -G "$wheels/llama_cpp_python-$version-*.whl" > /dev/null; then
    source=$(PYTHON="$python" "$root/scripts/llama_cpp_source.sh" unpack "$work")
    # --no-cache-dir keeps pip from reusing a wheel built with other flags or patches.
    "$python" -m pip wheel --no-cache-dir --no-deps --no-build-isolation -w "$work/built" "$source"
    # Moved in whole once built: an interrupted build leaves nothing to be taken for a wheel.
    mkdir -p "$wheels"
    mv "$work"/built/llama_cpp_python-"$version"-*.whl "$wheels"/
fi
# --force-reinstall replaces a copy already installed (pip calls any 0.3.x "satisfied").
"$python" -m pip install --no-cache-dir --force-reinstall --no-deps "$wheels"/llama_cpp_python-"$version"-*.whl
# Found, not imported: its dependencies are installed after it.
package=$("$python" -c 'import importlib.util; print(importlib.util.find_spec("llama_cpp").submodule_search_locations[0])')
# Every switch the patches add (each exports ggml_*_supported) is in the build, or the build
# stops: deterministic mode would otherwise take other kernels without a word.
nm -D --defined-only "$package"/lib/lib*.so > "$work/symbols"
for symbol in $(grep -ho 'int ggml_[a-z0-9_]*_supported(void)' "$root"/patches/llama.cpp/*.patch | sed 's/^int \(.*\)(void)$/\1/' | sort -u); do
    if ! grep -qw "$symbol" "$work/symbols"; then
        echo "scripts/build_llama_cpp_python.sh: the build lacks $symbol, which patches/llama.cpp adds" >&2
        exit 1
    fi
done
# What this build is, beside the library: prompt-cache states on disk are only reused by a
# build of the same sources, patches and options (fastrun_cpp.runtime.model_runtime).
patches_sha=$(cat "$root"/patches/llama.cpp/*.patch | sha256sum | cut -d' ' -f1)
"$python" -c '
import json, pathlib, sys
package, version, patches, cmake_args = sys.argv[1:5]
stamp = pathlib.Path(package) / "fastrun_build.json"
stamp.write_text(json.dumps({"version": version, "patches_sha256": patches, "cmake_args": cmake_args}) + "\n")
' "$package" "$version" "$patches_sha" "${CMAKE_ARGS:-}"
