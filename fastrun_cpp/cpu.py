"""The CPU at hand and the llama.cpp build: which instruction sets to compile in, and whether a
built library can run here.

Standard library only: `make setup` runs it (`python3 -m fastrun_cpp.cpu cmake-args`) before
any dependency is installed. The instruction sets come from the machine's own flags
(`/proc/cpuinfo`), never from a fixed list, so a build never uses an instruction the CPU lacks.
AMX stays off: llama.cpp's AMX kernels crash (`ggml_backend_amx_mul_mat`) on the CPUs tried.

`FASTRUN_CPU_FLAGS` (a space-separated flag list, as in /proc/cpuinfo) stands in for the
machine's flags, to build for, or test against, another CPU.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CPU_FLAGS_ENV = "FASTRUN_CPU_FLAGS"
CPUINFO = Path("/proc/cpuinfo")

# ggml's x86 build options and the /proc/cpuinfo flags each one makes the compiler use
# (GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw).
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512vbmi",)),
    ("GGML_AVX512_VNNI", ("avx512_vnni",)),
    ("GGML_AVX512_BF16", ("avx512_bf16",)),
)
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")

# What the container image and other portable builds assume of an x86-64 host: x86-64-v3
# (Haswell, 2013, and Zen 1 onwards).
X86_64_V3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})

# aarch64: /proc/cpuinfo "Features" -> the -march extension llama.cpp's CPU backend uses,
# and the architecture level that first has it (as ggml's own CPU variants do). SME stays
# off: its kernels need streaming mode support that Linux VMs often lack. i8mm stays off too:
# with it ggml multiplies Q4_0, Q4_1, Q8_0 and Q4_K two rows at a time when a batch has an even
# number of rows, in another float order than one row alone, so an answer would depend on
# what else was in the batch (exact mode's promise). armv8.6-a, the level sve2 takes, has i8mm
# in it: it is taken out again by name (+noi8mm).
ARM_EXTENSIONS: tuple[tuple[str, str, str], ...] = (
    ("asimddp", "+dotprod", "armv8.2-a"),
    ("asimdhp", "+fp16", "armv8.2-a"),
    ("sve", "+sve", "armv8.2-a"),
    ("sve2", "+sve2", "armv8.6-a"),
)
ARM_LEVEL_WITH_I8MM = "armv8.6-a"  # GCC's and Clang's armv8.6-a and later enable i8mm (and bf16)

# llama_print_system_info()'s CPU features -> the flags the CPU must have for each.
SYSTEM_INFO_FLAGS: dict[str, tuple[str, ...]] = {
    "SSE3": ("pni",),
    "SSSE3": ("ssse3",),
    "AVX": ("avx",),
    "AVX_VNNI": ("avx_vnni",),
    "AVX2": ("avx2",),
    "F16C": ("f16c",),
    "FMA": ("fma",),
    "BMI2": ("bmi2",),
    "AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),  # what GGML_AVX512 compiles with
    "AVX512_VBMI": ("avx512vbmi",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AMX_INT8": ("amx_int8",),
    "NEON": ("asimd",),
    "DOTPROD": ("asimddp",),
    "FP16_VA": ("asimdhp",),
    "MATMUL_INT8": ("i8mm",),
    "SVE": ("sve",),
    "SVE2": ("sve2",),
    "SME": ("sme",),
}


def machine() -> str:
    name = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (x86 "flags", ARM "Features"), or the
    FASTRUN_CPU_FLAGS stand-in."""
    given = os.environ.get(CPU_FLAGS_ENV)
    if given is not None:
        return frozenset(given.split())
    try:
        text = CPUINFO.read_text(encoding="ascii", errors="ignore")
    except OSError:
        return frozenset()
    match = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else frozenset()


def cpu_name() -> str:
    try:
        text = CPUINFO.read_text(encoding="ascii", errors="ignore")
    except OSError:
        return platform.processor() or "unknown CPU"
    match = re.search(r"^(?:model name|Model|CPU part)\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown CPU"


# llamafile's tinyBLAS matrix kernels, as in llama.cpp's default build (1.4x ggml's own prompt
# speed on Q8_0 and Q5_0 weights). Deterministic mode keeps them batch-invariant with a switch
# (patches/llama.cpp/0004, GGML_CPU_LLAMAFILE_BATCH_INVARIANT).
COMMON_ARGS = ("-DGGML_LLAMAFILE=ON",)


# Instruction scheduling for the CPU at hand, as llama.cpp's default build (GGML_NATIVE=ON,
# -march=native) gets it with its instruction sets: the same instructions are ordered for this
# core instead of a generic one. It never adds an instruction (the sets stay the explicit ones
# above). On an AVX2 AMD EPYC (Zen 3), llama-bench's 8-row prompt step on a 3B Q4_K_M model ran
# 17.5-18.1 tok/s tuned against 14.9-15.0 generic (bench/RESULTS.md, "Tuned for the CPU").
TUNE_FOR_THIS_CPU = ("-DCMAKE_C_FLAGS=-mtune=native", "-DCMAKE_CXX_FLAGS=-mtune=native")


def cmake_args(flags: frozenset[str] | None = None, arch: str | None = None) -> list[str]:
    """llama.cpp's CMake options for a CPU with these flags: every instruction set it has,
    none it lacks, AMX off; scheduled for this CPU when the build is for it (its own flags
    on x86-64), generic otherwise (another CPU's flags, a portable image)."""
    arch = arch or machine()
    for_this_cpu = flags is None and CPU_FLAGS_ENV not in os.environ and arch == machine() == "x86_64"
    return [*_isa_args(cpu_flags() if flags is None else flags, arch), *COMMON_ARGS,
            *(TUNE_FOR_THIS_CPU if for_this_cpu else ())]


def _isa_args(flags: frozenset[str], arch: str) -> list[str]:
    if arch == "x86_64":
        args = ["-DGGML_NATIVE=OFF"]
        args += [f"-D{option}={'ON' if set(needs) <= flags else 'OFF'}" for option, needs in X86_OPTIONS]
        return args + [f"-D{option}=OFF" for option in ALWAYS_OFF]
    if arch == "aarch64":
        level, extensions = "armv8-a", ""
        for feature, extension, min_level in ARM_EXTENSIONS:
            if feature in flags:
                extensions += extension
                level = max(level, min_level)
        if level >= ARM_LEVEL_WITH_I8MM:
            extensions += "+noi8mm"
        return ["-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={level}{extensions}"]
    # Other architectures (POWER, RISC-V, s390x...): the compiler's view of this machine.
    return ["-DGGML_NATIVE=ON"]


def x86_64_v3_args() -> list[str]:
    """A portable x86-64 build (the CPU container image): x86-64-v3, nothing above it."""
    return cmake_args(X86_64_V3, "x86_64")


# ------------------------------------------------------------------ checking a build

@dataclass(frozen=True)
class BuildCheck:
    features: tuple[str, ...]  # CPU features the llama.cpp build uses (llama_print_system_info)
    missing: tuple[str, ...]  # of those, what this CPU lacks
    crashed: str | None = None  # the probe failed: why, with the end of what it printed
    illegal_instruction: bool = False  # it died of SIGILL: built for another CPU

    @property
    def ok(self) -> bool:
        return not self.missing and self.crashed is None

    @property
    def wrong_cpu(self) -> bool:
        return bool(self.missing) or self.illegal_instruction


def parse_system_info(info: str) -> tuple[str, ...]:
    """The CPU features llama.cpp says it was built with: `CPU : AVX = 1 | AVX2 = 1 | ...`."""
    found = []
    for name, value in re.findall(r"([A-Z][A-Z0-9_]*) = (\d+)", info):
        if value != "0" and name in SYSTEM_INFO_FLAGS and name not in found:
            found.append(name)
    return tuple(found)


def missing_features(features: tuple[str, ...], flags: frozenset[str]) -> tuple[str, ...]:
    return tuple(name for name in features if not set(SYSTEM_INFO_FLAGS[name]) <= flags)


_PROBE = (
    "import llama_cpp.llama_cpp as l; l.llama_backend_init(); "
    "print(l.llama_print_system_info().decode('utf-8', 'replace'))"
)


class BuildProbe:
    """A build check under way: a child process loads llama.cpp (an illegal instruction kills
    the child, not us) while the caller goes on; `result` compares the CPU features it was
    built with against this CPU's flags."""

    def __init__(self, python: str = sys.executable, timeout_s: float = 120) -> None:
        self._deadline = time.monotonic() + timeout_s
        self._process = subprocess.Popen([python, "-c", _PROBE], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)

    def result(self) -> BuildCheck:
        try:
            stdout, stderr = self._process.communicate(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            return BuildCheck((), (), crashed="loading llama.cpp did not finish")
        returncode = self._process.returncode
        if returncode != 0:
            if returncode == -signal.SIGILL:
                return BuildCheck((), (), crashed="loading llama.cpp died of an illegal instruction",
                                  illegal_instruction=True)
            # Anything else (a CUDA build with no GPU device or driver, a missing library) is not
            # about the CPU: say what the loader printed.
            said = " / ".join(line.strip() for line in stderr.strip().splitlines()[-3:])
            return BuildCheck((), (), crashed=f"loading llama.cpp failed (exit status {returncode})"
                                              + (f": {said[:500]}" if said else ""))
        features = parse_system_info(stdout)
        flags = cpu_flags()
        if not flags:  # the flags cannot be read here: trust a build that loaded
            return BuildCheck(features, ())
        return BuildCheck(features, missing_features(features, flags))


def check_build(python: str = sys.executable, timeout_s: float = 120) -> BuildCheck:
    """Whether the llama.cpp build runs on this CPU (BuildProbe, waited for)."""
    return BuildProbe(python, timeout_s).result()


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "cmake-args"
    if command == "cmake-args":
        print(" ".join(cmake_args()))
    elif command == "portable-cmake-args":
        print(" ".join(x86_64_v3_args() if machine() == "x86_64" else cmake_args(frozenset(), machine())))
    elif command == "check":
        check = check_build()
        print(f"built with: {' '.join(check.features) or '?'}")
        if not check.ok:
            print(f"not usable on this CPU: {check.crashed or 'lacks ' + ' '.join(check.missing)}")
            return 1
    else:
        print("usage: python -m fastrun_cpp.cpu [cmake-args | portable-cmake-args | check]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
