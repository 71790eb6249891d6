"""Process-wide llama.cpp setup: backend initialisation and log routing into Python logging."""

from __future__ import annotations

import ctypes
import logging
import threading

import llama_cpp.llama_cpp as llama

logger = logging.getLogger("fastrun_cpp.llama")

# ggml_log_level -> logging level; GGML_LOG_LEVEL_CONT (5) continues the previous line.
# llama.cpp's INFO covers every tensor it loads: that is DEBUG to a server operator.
_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}

_init_lock = threading.Lock()
_initialized = False
_line_buffer: list[str] = []
_line_level = logging.DEBUG


@llama.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _line_level
    if level != 5:
        _line_level = _LEVELS.get(level, logging.DEBUG)
    if not logger.isEnabledFor(_line_level):
        return
    _line_buffer.append(text.decode("utf-8", errors="replace"))
    if _line_buffer[-1].endswith("\n"):
        logger.log(_line_level, "%s", "".join(_line_buffer).rstrip())
        _line_buffer.clear()


def init_backend() -> None:
    """Initialise llama.cpp once per process; safe to call from anywhere."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        llama.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama.llama_backend_init()
        _initialized = True


def system_info() -> str:
    init_backend()
    return llama.llama_print_system_info().decode("utf-8", errors="replace").strip()
