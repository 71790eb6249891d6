"""The llama.cpp build matches the CPU it runs on; a build for another CPU refuses to start
with one clear line instead of dying of an illegal instruction."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastrun_cpp import cpu
from tests.server import free_port

# /proc/cpuinfo flags of real machines (trimmed to what matters here).
AMD_EPYC_AVX2 = "fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 sha_ni"
SAPPHIRE_RAPIDS = (
    "fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw "
    "avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8"
)
GRAVITON3 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp sve i8mm bf16 svei8mm"
RASPBERRY_PI_4 = "fp asimd evtstrm crc32 cpuid"


def options(args: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("-D").split("=", 1) for arg in args)


def test_avx2_machine_gets_no_avx512():
    built = options(cpu.cmake_args(frozenset(AMD_EPYC_AVX2.split()), "x86_64"))
    assert built["GGML_NATIVE"] == "OFF"
    assert built["GGML_AVX2"] == built["GGML_FMA"] == built["GGML_F16C"] == built["GGML_BMI2"] == "ON"
    assert all(value == "OFF" for name, value in built.items() if "AVX512" in name or "AMX" in name)


def test_amx_machine_gets_avx512_but_never_amx():
    built = options(cpu.cmake_args(frozenset(SAPPHIRE_RAPIDS.split()), "x86_64"))
    assert built["GGML_AVX512"] == built["GGML_AVX512_VNNI"] == built["GGML_AVX512_BF16"] == "ON"
    assert built["GGML_AMX_TILE"] == built["GGML_AMX_INT8"] == built["GGML_AMX_BF16"] == "OFF"


def test_avx512_needs_all_of_its_parts():
    partial = frozenset(AMD_EPYC_AVX2.split()) | {"avx512f"}  # no avx512bw/vl/dq/cd
    assert options(cpu.cmake_args(partial, "x86_64"))["GGML_AVX512"] == "OFF"


@pytest.mark.parametrize("flags, arch", [(GRAVITON3, "armv8.2-a+dotprod+fp16+sve"),
                                         (RASPBERRY_PI_4, "armv8-a")])
def test_arm_machines_get_their_own_extensions(flags, arch):
    built = options(cpu.cmake_args(frozenset(flags.split()), "aarch64"))
    assert built["GGML_NATIVE"] == "OFF" and built["GGML_CPU_ARM_ARCH"] == arch


# A Neoverse V2 (Graviton4, Grace): sve2 and i8mm.
NEOVERSE_V2 = GRAVITON3 + " sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svebf16 i8mm"


@pytest.mark.parametrize("flags", [GRAVITON3, NEOVERSE_V2])
def test_no_arm_build_turns_i8mm_on(flags):
    """ggml's i8mm kernels take rows two at a time in another float order than one row alone:
    with them an answer depends on its batch. The -march level sve2 needs (armv8.6-a) enables
    i8mm by itself, so the build names it off; no level or extension we pick leaves
    __ARM_FEATURE_MATMUL_INT8 (system_info's MATMUL_INT8) defined."""
    arch = options(cpu.cmake_args(frozenset(flags.split()), "aarch64"))["GGML_CPU_ARM_ARCH"]
    level, *extensions = arch.split("+")
    assert "i8mm" not in extensions
    if level >= cpu.ARM_LEVEL_WITH_I8MM or level.startswith("armv9"):
        assert extensions[-1] == "noi8mm", arch
    assert ("sve2" in extensions) == ("sve2" in flags.split())


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None,
                    reason="needs an aarch64 cross compiler (Debian's gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("flags", [GRAVITON3, NEOVERSE_V2])
def test_the_compiler_defines_no_int8_matmul_for_our_arm_level(flags):
    """What ggml's sources test (__ARM_FEATURE_MATMUL_INT8) under the -march we give, as the
    compiler sees it; the extensions we asked for are there."""
    arch = options(cpu.cmake_args(frozenset(flags.split()), "aarch64"))["GGML_CPU_ARM_ARCH"]
    macros = subprocess.run(["aarch64-linux-gnu-gcc", f"-march={arch}", "-dM", "-E", "-"], input="",
                            capture_output=True, text=True, timeout=60, check=True).stdout
    assert "__ARM_FEATURE_MATMUL_INT8" not in macros
    assert ("__ARM_FEATURE_SVE2 " in macros) == ("sve2" in flags.split())


def test_portable_image_build_is_x86_64_v3():
    built = options(cpu.x86_64_v3_args())
    assert {name for name, value in built.items() if value == "ON"} == {
        "GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_LLAMAFILE"}


def test_a_build_for_this_cpu_is_scheduled_for_it_and_no_other_build_is(monkeypatch):
    """-mtune=native orders instructions for the core that compiles; it is right only where the
    build runs there: not for another CPU's flags (FASTRUN_CPU_FLAGS, an argument) nor the image."""
    monkeypatch.delenv(cpu.CPU_FLAGS_ENV, raising=False)
    tuned = set(cpu.TUNE_FOR_THIS_CPU)
    assert tuned <= set(cpu.cmake_args()) or cpu.machine() != "x86_64"
    assert not tuned & set(cpu.cmake_args(frozenset(AMD_EPYC_AVX2.split()), "x86_64"))
    assert not tuned & set(cpu.x86_64_v3_args())
    monkeypatch.setenv(cpu.CPU_FLAGS_ENV, AMD_EPYC_AVX2)
    assert not tuned & set(cpu.cmake_args())


def test_every_build_has_llamafile_as_llama_cpp_default_does():
    """Its kernels are what a user's llama-server runs; exact mode keeps them batch-invariant
    with a run-time switch (patches/llama.cpp/0004), so one build serves both modes."""
    for built in (cpu.cmake_args(frozenset(AMD_EPYC_AVX2.split()), "x86_64"), cpu.x86_64_v3_args(),
                  cpu.cmake_args(frozenset(GRAVITON3.split()), "aarch64")):
        assert options(built)["GGML_LLAMAFILE"] == "ON"


@pytest.mark.skipif(not cpu.CPUINFO.exists(), reason="needs /proc/cpuinfo")
def test_built_library_uses_only_instruction_sets_this_cpu_has():
    """The installed llama.cpp reports the CPU features it was compiled with; each must be one
    this machine's /proc/cpuinfo lists."""
    check = cpu.check_build()
    assert check.crashed is None
    assert check.features, "llama.cpp reported no CPU features"
    flags = cpu.cpu_flags()
    for feature in check.features:
        assert set(cpu.SYSTEM_INFO_FLAGS[feature]) <= flags, f"built with {feature}, which this CPU lacks"
    assert check.ok


def test_system_info_parsing():
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |"
    assert cpu.parse_system_info(info) == ("SSE3", "AVX", "AVX2")
    assert cpu.missing_features(("SSE3", "AVX", "AVX2"), frozenset({"pni", "avx"})) == ("AVX2",)


def test_server_refuses_to_start_on_a_cpu_the_build_does_not_fit(tmp_path):
    """As on a machine lacking what the library was built with: one line, exit status 2, no
    SIGILL."""
    if not cpu.check_build().features:
        pytest.skip("this build reports no CPU features to miss")
    result = subprocess.run(
        [sys.executable, "-m", "fastrun_cpp", "serve", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, cpu.CPU_FLAGS_ENV: "fpu sse sse2",
             "FASTRUN_KEYS_DB": str(tmp_path / "keys.sqlite3")},
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, result.stderr
    assert "built for another CPU" in errors[0] and "make setup" in errors[0]


def test_avx512_build_needs_every_flag_it_compiles_with():
    """GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: a CPU lacking any one cannot run it."""
    without_bw = frozenset(SAPPHIRE_RAPIDS.split()) - {"avx512bw"}
    assert cpu.missing_features(("AVX2", "AVX512"), without_bw) == ("AVX512",)
    assert cpu.missing_features(("AVX2", "AVX512"), frozenset(SAPPHIRE_RAPIDS.split())) == ()


def fake_python(tmp_path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_a_probe_that_fails_says_why_and_is_not_called_another_cpu(tmp_path):
    """A CUDA build with no GPU, a missing library...: the probe's own words, not 'another CPU'."""
    failing = fake_python(tmp_path, "import sys; print('ggml_cuda_init: no CUDA-capable device', file=sys.stderr); "
                                    "sys.exit(1)")
    check = cpu.check_build(python=failing)
    assert not check.ok and not check.wrong_cpu
    assert "no CUDA-capable device" in check.crashed


def test_an_illegal_instruction_is_another_cpu(tmp_path):
    dying = fake_python(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    check = cpu.check_build(python=dying)
    assert check.wrong_cpu and "illegal instruction" in check.crashed


def test_make_setup_rebuilds_for_another_cpu_in_a_set_up_venv():
    """pip calls an installed llama-cpp-python 'already satisfied' whatever it was built for:
    a new CPU's options must force a rebuild from source, and drop the old stamp. (A dry run:
    the build itself takes minutes; `make setup` with these flags runs exactly this.)"""
    avx2 = "fpu sse sse2 pni ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2"
    avx512 = avx2 + " avx512f avx512bw avx512cd avx512dq avx512vl"
    # Another CPU than this one: an AVX2-only machine (an AMD EPYC) forges an AVX-512 one.
    forged, built_for = (avx2, "-DGGML_AVX512=OFF")
    this_cpu = [arg for arg in cpu.cmake_args() if arg not in cpu.TUNE_FOR_THIS_CPU]
    if cpu.cmake_args(frozenset(avx2.split())) == this_cpu:
        forged, built_for = (avx512, "-DGGML_AVX512=ON")
    result = subprocess.run(["make", "-n", "setup"], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            env={**os.environ, cpu.CPU_FLAGS_ENV: forged})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any("scripts/build_llama_cpp_python.sh" in line for line in lines)
    script = (Path(__file__).resolve().parent.parent / "scripts" / "build_llama_cpp_python.sh").read_text()
    assert "--force-reinstall" in script and "--no-cache-dir" in script and "patches/llama.cpp" in script
    assert built_for in result.stdout and "-DGGML_AVX2=ON" in result.stdout
    assert any(line.startswith("rm -f") and ".llama-cpp-python-" in line for line in lines)
