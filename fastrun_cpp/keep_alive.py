"""Ollama's keep_alive: how long a model stays loaded once idle."""

from __future__ import annotations

import math
import re

FOREVER = math.inf
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: str | float | int) -> float:
    """Ollama's keep_alive: seconds, or a Go duration ("5m", "1h30m", "250ms"); 0 unloads the
    model once its last request ends, and anything negative keeps it loaded for good (FOREVER)."""
    if isinstance(value, bool):
        raise ValueError("keep_alive is a duration or a number of seconds, not a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        if len(text) > 40:
            raise ValueError("keep_alive is too long for a duration")
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if re.fullmatch(r"[0-9]+(\.[0-9]+)?", body):
            seconds = sign * float(body)
        else:
            parts = _DURATION_PART.findall(body)
            if not body or "".join(number + unit for number, unit in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration such as 5m, 1h30m or 300 (seconds)")
            seconds = sign * sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if math.isnan(seconds):
        raise ValueError("keep_alive is not a number")
    return FOREVER if seconds < 0 or seconds > 10 * 365 * 86400 else seconds
