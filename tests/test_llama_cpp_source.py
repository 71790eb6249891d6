"""llama.cpp's sources come from one script (scripts/llama_cpp_source.sh): the pinned sdist,
checked against patches/llama.cpp/BASE, patched exactly or not at all. Run on a copy of the
checkout's build files, so a broken patch or a bump without a rebase is shown to stop the build
rather than change the kernels without a word."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "scripts/llama_cpp_source.sh"


def checkout_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / SCRIPT, copy / SCRIPT)
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    shutil.copytree(ROOT / "patches", copy / "patches")
    return copy


def source_script(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def sdist_dir(tmp_path_factory) -> Path:
    """The pinned sdist, downloaded once (from the package index, as `make setup` does)."""
    directory = tmp_path_factory.mktemp("sdist")
    result = source_script(ROOT, "unpack", str(directory), "--unpatched")
    assert result.returncode == 0, result.stderr
    return directory


def test_the_version_is_the_one_pyproject_pins():
    result = source_script(ROOT, "version")
    assert result.returncode == 0
    assert f'"llama-cpp-python=={result.stdout.strip()}"' in (ROOT / "pyproject.toml").read_text()


def test_a_version_bump_without_a_rebase_stops_before_anything_is_built(tmp_path):
    checkout = checkout_copy(tmp_path)
    pyproject = checkout / "pyproject.toml"
    version = source_script(ROOT, "version").stdout.strip()
    pyproject.write_text(pyproject.read_text().replace(f"llama-cpp-python=={version}", "llama-cpp-python==9.9.9"))
    result = source_script(checkout, "unpack", str(tmp_path / "work"))
    assert result.returncode == 1
    assert "rebase the patches" in result.stderr and "9.9.9" in result.stderr
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


def test_the_patches_apply_exactly_to_the_recorded_sources(sdist_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    version = source_script(ROOT, "version").stdout.strip()
    shutil.copy(sdist_dir / f"llama_cpp_python-{version}.tar.gz", work)
    result = source_script(ROOT, "unpack", str(work))
    assert result.returncode == 0, result.stderr
    source = Path(result.stdout.strip())
    # Each patch's switch (the symbol the build checks for) is in the patched sources, and only there.
    unpatched = sdist_dir / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp" / "ggml"
    symbols = sorted({match for patch in (ROOT / "patches" / "llama.cpp").glob("*.patch")
                      for match in re.findall(r"^\+.*\bint (ggml_\w+_supported)\(void\)", patch.read_text(), re.M)})
    assert len(symbols) >= 3
    for symbol in symbols:
        assert subprocess.run(["grep", "-rqw", symbol, str(source / "vendor" / "llama.cpp" / "ggml")]).returncode == 0
        assert subprocess.run(["grep", "-rqw", symbol, str(unpatched)]).returncode == 1, symbol


def test_a_patch_that_only_applies_with_fuzz_stops_the_build(sdist_dir, tmp_path):
    checkout = checkout_copy(tmp_path)
    version = source_script(ROOT, "version").stdout.strip()
    # A hunk whose leading context line is not what the sources have: GNU patch's default fuzz
    # applies it anyway, at the place it guesses.
    (checkout / "patches" / "llama.cpp" / "9999-fuzzy.patch").write_text(
        "--- a/vendor/llama.cpp/CMakeLists.txt\n"
        "+++ b/vendor/llama.cpp/CMakeLists.txt\n"
        "@@ -1,4 +1,5 @@\n"
        " cmake_minimum_required(VERSION 3.99) # not the line the sources have\n"
        " project(\"llama.cpp\" C CXX)\n"
        " include(CheckIncludeFileCXX)\n"
        "+# fuzzy\n"
        " \n")
    plain = tmp_path / "plain"
    plain.mkdir()
    subprocess.run(["tar", "xzf", str(sdist_dir / f"llama_cpp_python-{version}.tar.gz"), "-C", str(plain)],
                   check=True)
    fuzzy = (checkout / "patches" / "llama.cpp" / "9999-fuzzy.patch").read_text()
    with_fuzz = subprocess.run(["patch", "-d", str(plain / f"llama_cpp_python-{version}"), "-p1"], input=fuzzy,
                               capture_output=True, text=True)
    assert with_fuzz.returncode == 0 and "fuzz" in with_fuzz.stdout  # what --fuzz=0 is there for
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(sdist_dir / f"llama_cpp_python-{version}.tar.gz", work)
    result = source_script(checkout, "unpack", str(work))
    assert result.returncode == 1
    assert "9999-fuzzy.patch does not apply exactly" in result.stderr


def test_an_sdist_other_than_the_recorded_one_is_refused(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    version = source_script(ROOT, "version").stdout.strip()
    (work / f"llama_cpp_python-{version}.tar.gz").write_bytes(b"not the sdist")
    result = source_script(ROOT, "unpack", str(work))
    assert result.returncode == 1 and "is not the sdist" in result.stderr
