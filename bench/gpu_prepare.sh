#!/usr/bin/env bash
# Prepare what bench/gpu_matrix.sh needs on a GPU machine that downloads nothing, here (where
# pip works): .whl/ (fastrun-cpp's runtime dependencies at this venv's versions, as cp312
# manylinux wheels, minus what that machine's image already has) and .gpu/src.tar.gz (the
# llama-cpp-python sdist's Python package and vendored llama.cpp with patches/ applied, without
# its models, docs, tests and examples). Both are git-ignored through .git/info/exclude; carry
# them, and .bench/tiny.gguf, with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
version=$(scripts/llama_cpp_source.sh version)
exclude="$(git rev-parse --git-dir)/info/exclude"
grep -qx "/.whl/" "$exclude" 2>/dev/null || printf "/.whl/\n/.gpu/\n" >>"$exclude"
# The dependency closure of what the server imports, at this venv's versions.
requirements=$("$python" - <<'PY'
import importlib.metadata as metadata, re
from packaging.requirements import Requirement
# Already in the GPU image (bench/gpu_matrix.sh runs its python3): keep its own versions.
present = {"numpy", "pyyaml", "requests", "urllib3", "certifi", "idna", "charset-normalizer", "tqdm", "click",
           "attrs", "typing-extensions", "huggingface-hub"}
todo = ["fastapi", "uvicorn", "httptools", "sse-starlette", "pydantic-settings", "llguidance", "jsonschema",
        "prometheus-client", "gguf", "diskcache", "python-dotenv"]
seen = {}
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or name in present:
        continue
    dist = metadata.distribution(name)
    seen[name] = dist.version
    for line in dist.requires or []:
        requirement = Requirement(line)
        if not requirement.marker or requirement.marker.evaluate({"extra": ""}):
            todo.append(requirement.name)
print(" ".join(f"{name}=={version}" for name, version in sorted(seen.items())))
PY
)
rm -rf .whl && mkdir .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d .whl $requirements
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source=$(scripts/llama_cpp_source.sh unpack "$work")
rm -rf "$source"/vendor/llama.cpp/{models,docs,benches,tests} "$source"/vendor/llama.cpp/examples/*/
mkdir -p .gpu
tar czf .gpu/src.tar.gz -C "$work" "llama_cpp_python-$version/vendor/llama.cpp" "llama_cpp_python-$version/llama_cpp"
[[ -f .bench/tiny.gguf ]] || "$python" -m fastrun_cpp.tiny_model .bench/tiny.gguf
du -sh .whl .gpu .bench/tiny.gguf
