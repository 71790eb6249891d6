"""What a fresh machine installs: every import declared (deptry), the lock complete and true to
pyproject.toml, and every install (make setup, make setup-test, the Containerfile) taken from
the lock with hashes. The install itself, from nothing, is `.ci/run`'s first step
(scripts/serve_check.py --make)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def deptry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deptry", "--no-ansi", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_every_import_of_the_server_is_declared():
    result = deptry("fastrun_cpp")
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_import_satisfied_only_through_another_package_fails_the_check(tmp_path):
    """httpx came with huggingface-hub 1.x and left with 2.x: declared only through another
    package, it is an import deptry refuses (DEP003), not one it lets pass while it happens to
    be installed."""
    text = (ROOT / "pyproject.toml").read_text()
    without = re.sub(r'\n    "httpx[^"]*",', "", text, count=1)
    assert without != text
    config = tmp_path / "pyproject.toml"
    config.write_text(without)
    result = deptry("fastrun_cpp", "--config", str(config))
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"DEP00[13] 'httpx' imported but", result.stdout + result.stderr)


def pins(lock: str) -> dict[tuple[str, str], str]:
    """(name, environment marker) -> version, for every pin of a lock file."""
    found = {}
    for line in (ROOT / "requirements" / lock).read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)\s*(?:;\s*([^\\]*?))?\s*\\?$", line)
        if match:
            found[(canonicalize_name(match[1]), (match[3] or "").strip())] = match[2]
    return found


@pytest.mark.parametrize("lock", ["build.txt", "serve.txt", "test.txt", "model.txt"])
def test_every_pin_of_every_lock_carries_hashes(lock):
    text = (ROOT / "requirements" / lock).read_text()
    entries = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[2])  # after the two header lines
    entries = [entry for entry in entries if re.match(r"^[A-Za-z0-9_.\-]+==", entry)]
    assert entries and all("--hash=sha256:" in entry for entry in entries), lock


def test_the_serve_lock_is_the_tested_set():
    """make serve installs the same versions the suite ran on: serve.txt is test.txt's subset."""
    serve, test = pins("serve.txt"), pins("test.txt")
    tested = {(name, version) for (name, _), version in test.items()}
    assert all((name, version) in tested for (name, _), version in serve.items()), \
        sorted((name, version) for (name, _), version in serve.items() if (name, version) not in tested)


@pytest.mark.parametrize("lock, extras", [("serve.txt", ()), ("test.txt", ("test", "ray"))])
def test_the_lock_holds_every_declared_dependency_at_a_version_it_allows(lock, extras):
    """A dependency added to pyproject.toml without `make lock` would be missing here, and a lower
    bound raised past the lock would be refused here."""
    locked = pins(lock)
    declared = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        declared += PYPROJECT["project"]["optional-dependencies"][extra]
    for spec in map(Requirement, declared):
        name = canonicalize_name(spec.name)
        if name == "llama-cpp-python":  # built from its sdist with our patches, not taken from the lock
            continue
        versions = [version for (pinned, _), version in locked.items() if pinned == name]
        assert versions, f"{spec} is declared but not in requirements/{lock}: run make lock"
        assert all(spec.specifier.contains(version, prereleases=True) for version in versions), (spec, versions)


def test_make_installs_only_from_the_lock_with_hashes():
    """Every pip install `make setup-test` runs takes a lock with --require-hashes, but for this
    checkout itself (-e .) and llama-cpp-python's own build."""
    result = subprocess.run(["make", "-n", "-B", "setup-test", "VENV=/nonexistent-venv"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    installs = [line for line in result.stdout.splitlines() if "pip install" in line]
    for lock in ("build.txt", "serve.txt", "test.txt", "model.txt"):
        assert any(f"-r requirements/{lock}" in line and "--require-hashes" in line for line in installs), lock
    loose = [line for line in installs if "--require-hashes" not in line and "-e ." not in line]
    assert loose == [], loose


def test_the_container_installs_the_runtime_lock_alone():
    containerfile = (ROOT / "Containerfile").read_text()
    assert "--require-hashes -r requirements/serve.txt" in containerfile
    assert "--require-hashes -r requirements/build.txt" in containerfile
    assert "requirements/test.txt" not in containerfile and "[test" not in containerfile


def test_requires_python_is_the_locks_oldest_python():
    """requires-python and the lock agree (`make lock` resolves from 3.10), and .ci/run serves
    on that Python before the suite."""
    assert PYPROJECT["project"]["requires-python"] == ">=3.10"
    assert "--python-version 3.10" in (ROOT / "Makefile").read_text()
    assert "3.10" in (ROOT / ".ci" / "run").read_text()
