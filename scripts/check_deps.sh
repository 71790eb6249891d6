#!/usr/bin/env bash
# Every module imported is a declared dependency, checked by deptry against pyproject.toml in a
# venv holding the locked set (make check-deps; CI before the suite):
#   - fastrun_cpp against the runtime dependencies and the ray extra: a module satisfied only
#     through another package (DEP003), or not at all (DEP001), or a test tool (DEP004) fails;
#   - tests/, bench/ and scripts/ against those and the test extra (unused ones are no error
#     there: the server's dependencies are not theirs to use).
#
#   scripts/check_deps.sh [PYTHON]      PYTHON: the venv's (default .venv/bin/python)
set -euo pipefail
python=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
echo "== deptry fastrun_cpp (the server)"
"$python" -m deptry fastrun_cpp
echo "== deptry tests bench scripts (test extra counted)"
"$python" -m deptry tests bench scripts --exclude "(^|/)(\.venv[^/]*|build|__pycache__)/" --ignore DEP002,DEP004
