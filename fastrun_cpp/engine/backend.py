"""Process-wide llama.cpp setup: backend initialisation and log routing into Python logging."""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from collections import Counter

import llama_cpp.llama_cpp as llama

logger = logging.getLogger("fastrun_cpp.llama")

# ggml_log_level -> logging level; GGML_LOG_LEVEL_CONT (5) continues the previous line.
# llama.cpp's INFO covers every tensor it loads: that is DEBUG to a server operator.
_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}

_init_lock = threading.Lock()
_initialized = False
_line_buffer: list[str] = []
_line_level = logging.DEBUG


# llama.cpp's report of each buffer it allocates ("CPU_Mapped model buffer size = 82.82 MiB").
_BUFFER_LINE = re.compile(rb"(\S+)\s+(model|KV|output|compute) buffer size\s*=\s*([0-9.]+) MiB")


class BufferReport:
    """What llama.cpp says it allocated while this report listens: bytes by (device, kind),
    device as llama.cpp names its buffer (CPU, CPU_Mapped, CPU_REPACK, CUDA0, CUDA_Host...).
    One report listens at a time (model loads take turns)."""

    def __init__(self) -> None:
        self.bytes: Counter[tuple[str, str]] = Counter()

    def __enter__(self) -> BufferReport:
        global _listening
        _listening = self
        return self

    def __exit__(self, *exc) -> None:
        global _listening
        _listening = None

    def total(self, *, gpu: bool | None = None) -> int:
        return sum(size for (device, _), size in self.bytes.items() if gpu is None or is_gpu_buffer(device) == gpu)


def is_gpu_buffer(device: str) -> bool:
    """A buffer in a GPU's memory (CUDA0, Vulkan1, ...); host buffers (CPU*, *_Host) are RAM."""
    return not device.startswith("CPU") and not device.endswith("_Host")


_listening: BufferReport | None = None


@llama.llama_log_callback
def _log_callback(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _line_level
    if level != 5:
        _line_level = _LEVELS.get(level, logging.DEBUG)
    report = _listening
    if report is not None and b"buffer size" in text:
        match = _BUFFER_LINE.search(text)
        if match:
            report.bytes[(match[1].decode(), match[2].decode())] += int(float(match[3]) * 2**20)
    if not logger.isEnabledFor(_line_level):
        return
    _line_buffer.append(text.decode("utf-8", errors="replace"))
    if _line_buffer[-1].endswith("\n"):
        logger.log(_line_level, "%s", "".join(_line_buffer).rstrip())
        _line_buffer.clear()


def route_logs(set_log_callback) -> None:
    """Send a llama.cpp library's log (libmtmd's: `mtmd_log_set`) where llama.cpp's goes: to
    this package's logger, at the line's level."""
    set_log_callback(_log_callback, ctypes.c_void_p(0))


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
