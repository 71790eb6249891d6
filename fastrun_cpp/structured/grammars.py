"""The hand-written base grammars of `grammars/` (JSON value, JSON object)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

# In a source checkout (and an editable install) the files sit in the repository's
# grammars/; a wheel installs them under <prefix>/share/fastrun-cpp/grammars.
_LOCATIONS = (
    Path(__file__).resolve().parents[2] / "grammars",
    Path(sys.prefix) / "share" / "fastrun-cpp" / "grammars",
)


@functools.cache
def base_grammar(name: str) -> str:
    """The text of grammars/<name>.gbnf."""
    for directory in _LOCATIONS:
        path = directory / f"{name}.gbnf"
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise FileNotFoundError(f"grammar {name!r} not found in {', '.join(map(str, _LOCATIONS))}")
