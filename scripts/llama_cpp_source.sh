#!/usr/bin/env bash
# llama.cpp's sources as fastrun-cpp builds them: the llama-cpp-python sdist pyproject.toml pins,
# checked against patches/llama.cpp/BASE (its sha256, and the llama.cpp commit it vendors), with
# patches/llama.cpp/*.patch applied exactly where they were made (patch --fuzz=0) or not at all.
# The one place that reads the version and the one apply step: scripts/build_llama_cpp_python.sh
# (`make setup`, the Containerfile, bench/gpu_check.sh), bench/gpu_prepare.sh and, unpatched,
# bench/build_llama_server.sh use it.
#
#   scripts/llama_cpp_source.sh version                    the pinned llama-cpp-python version
#   scripts/llama_cpp_source.sh unpack DIR [--unpatched]   prints DIR/llama_cpp_python-VERSION
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base=$root/patches/llama.cpp/BASE
version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' "$root/pyproject.toml")
case "${1:-}" in
    version) echo "$version"; exit 0 ;;
    unpack) [[ $# -ge 2 ]] || { echo "usage: $0 unpack DIR [--unpatched]" >&2; exit 2; } ;;
    *) echo "usage: $0 version | unpack DIR [--unpatched]" >&2; exit 2 ;;
esac
dir=$2
patched=true
[[ ${3:-} == --unpatched ]] && patched=false
recorded=$(sed -n 's/^llama_cpp_python=//p' "$base")
if [[ $version != "$recorded" ]]; then
    echo "$0: pyproject.toml pins llama-cpp-python $version, and patches/llama.cpp/BASE records $recorded:" \
         "rebase the patches onto $version first (DEVELOPERS.md, \"Rebasing the llama.cpp patches\")" >&2
    exit 1
fi
mkdir -p "$dir"
sdist=$dir/llama_cpp_python-$version.tar.gz
[[ -f $sdist ]] || "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$dir" >&2
if ! echo "$(sed -n 's/^sdist_sha256=//p' "$base")  $sdist" | sha256sum --check --status; then
    echo "$0: $sdist is not the sdist patches/llama.cpp/BASE records (sha256)" >&2
    exit 1
fi
source=$dir/llama_cpp_python-$version
rm -rf "$source"
tar xzf "$sdist" -C "$dir"
if $patched; then
    for patch_file in "$root"/patches/llama.cpp/*.patch; do
        if ! patch -d "$source" -p1 --forward --fuzz=0 --quiet < "$patch_file" >&2; then
            echo "$0: $(basename "$patch_file") does not apply exactly to llama.cpp@$(sed -n \
                's/^llama_cpp_commit=//p' "$base")" >&2
            exit 1
        fi
    done
fi
echo "$source"
