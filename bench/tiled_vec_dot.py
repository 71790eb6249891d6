"""What exact mode's one-row K-quant kernels cost against ggml's vec_dot (patches/llama.cpp/0005).

    .venv/bin/python bench/tiled_vec_dot.py

Compiles bench/tiled_vec_dot.c against the installed llama-cpp-python's ggml libraries and
headers, then times, per type (Q2_K to Q6_K), a 3072-wide row against 512 weight rows (in
cache) and 16384 (41 MB at Q6_K; past L2, though a large L3 may hold it), on one thread: ns per
row for each kernel, best of several passes, each kernel on its own copy of the weights, taking
turns to go first. Ratio > 1: the tiled order is faster. Run it on an idle machine.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import llama_cpp

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    lib = Path(llama_cpp.__file__).with_name("lib")
    include = Path(sysconfig.get_paths()["purelib"]) / "include"
    with tempfile.TemporaryDirectory() as work:
        binary = Path(work) / "tiled_vec_dot"
        subprocess.run(["cc", "-O2", str(ROOT / "bench" / "tiled_vec_dot.c"), "-o", str(binary), f"-I{include}",
                        f"-L{lib}", "-lggml-cpu", "-lggml-base", "-lm", f"-Wl,-rpath,{lib}"], check=True)
        for rows, passes in ((512, 200), (16384, 10)):
            subprocess.run([str(binary), str(rows), str(passes)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
