#!/usr/bin/env python3
"""Copy the web page's libraries from their npm packages into fastrun_cpp/ui/assets/vendor/.

Each package at the version and integrity fastrun_cpp/ui/vendor.json names is fetched with
`npm pack` (the registry's own tarball, its sha512 checked against the manifest), and the files
the manifest lists are copied byte for byte: the page has no build step of its own.
`--check` copies nothing and fails when a checked-in file differs from its package's.

    python scripts/vendor_ui.py          # after changing a version (set its integrity too)
    python scripts/vendor_ui.py --check  # what tests/test_ui.py runs
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

UI = Path(__file__).resolve().parent.parent / "fastrun_cpp" / "ui"
MANIFEST = UI / "vendor.json"
VENDOR = UI / "assets" / "vendor"


def package_files(package: dict, workdir: Path) -> dict[str, bytes]:
    """The files `package` lists, read from the registry's tarball of its version."""
    spec = f"{package['name']}@{package['version']}"
    packed = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(workdir), spec],
                            check=True, capture_output=True, text=True, cwd=workdir)
    (info,) = json.loads(packed.stdout)
    tarball = workdir / info["filename"]
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    if integrity != package["integrity"]:
        raise SystemExit(f"{spec}: the registry's tarball is {integrity}, the manifest says {package['integrity']}")
    with tarfile.open(tarball) as tar:
        return {name: tar.extractfile(f"package/{inside}").read() for name, inside in package["files"].items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the checked-in copies; write nothing")
    args = parser.parse_args()
    manifest = json.loads(MANIFEST.read_text())
    differ = []
    with tempfile.TemporaryDirectory() as tmp:
        for package in manifest["packages"]:
            for name, content in package_files(package, Path(tmp)).items():
                target = VENDOR / name
                if args.check:
                    if not target.exists() or target.read_bytes() != content:
                        differ.append(f"{name} ({package['name']}@{package['version']})")
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
    listed = {name for package in manifest["packages"] for name in package["files"]}
    strays = sorted(path.name for path in VENDOR.iterdir() if path.name not in listed)
    if differ or strays:
        print("the vendored files are not their packages':", *differ, *(f"{s} (in no package)" for s in strays),
              sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
