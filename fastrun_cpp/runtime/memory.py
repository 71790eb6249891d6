"""What a model needs in memory before it is loaded: its weights, the KV cache of its slots, the
compute buffers, and the host RAM its prompt cache may fill, in RAM and in GPU memory.

The shape comes from the GGUF's own header (llama.cpp reads it without the weights); once the
model is loaded, llama.cpp's report of the buffers it allocated (engine.backend.BufferReport)
is put beside the estimate, and the larger of the two is what the model holds."""

from __future__ import annotations

import ctypes
import functools
import gc
import re
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.llama_cpp as llama

from fastrun_cpp.engine.backend import BufferReport
from fastrun_cpp.engine.errors import ModelLoadError
from fastrun_cpp.registry import ModelConfig

MiB = 2**20

# Bytes per element of each KV cache type (blocks of 32 for the quantized ones).
_KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                  "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """'12GiB', '512 MiB', '8G', '1073741824' -> bytes (binary units, as memory is counted)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size such as 8GiB or 512MiB")
    return int(float(match[1]) * _UNITS[(match[2] or "")[:1].lower()])


@dataclass(frozen=True)
class ModelShape:
    """A GGUF's hyperparameters that decide its memory."""

    n_layer: int
    n_embd: int
    n_vocab: int
    kv_width: int  # K and V elements per token per layer: (key_length + value_length) * heads_kv
    file_bytes: int  # the weights on disk (every shard)


def read_shape(path: Path) -> ModelShape:
    """The shape from the GGUF header, read by ggml's own GGUF parser: the metadata only, where a
    vocab-only llama.cpp load would also build the tokenizer (about 1 s for Gemma 3's 262k
    tokens, on every start)."""
    with _GgufHeader(path) as header:
        n_vocab = header.array_length("tokenizer.ggml.tokens") or 0
        architecture = header.string("general.architecture") or ""

        def number(key: str) -> int | None:
            return header.integer(f"{architecture}.{key}")

        n_layer = number("block_count") or 0
        n_embd = number("embedding_length") or 0
        n_head = number("attention.head_count") or 1
        n_head_kv = number("attention.head_count_kv") or n_head
        key_length = number("attention.key_length") or n_embd // n_head
        value_length = number("attention.value_length") or key_length
    return ModelShape(n_layer=n_layer, n_embd=n_embd, n_vocab=n_vocab, kv_width=(key_length + value_length) * n_head_kv,
                      file_bytes=sum(part.stat().st_size for part in _shards(path)))


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_GGUF_STRING, _GGUF_ARRAY = 8, 9
# ggml's gguf_type: the integer element types, as ctypes reads them.
_GGUF_INTEGERS = {0: ctypes.c_uint8, 1: ctypes.c_int8, 2: ctypes.c_uint16, 3: ctypes.c_int16, 4: ctypes.c_uint32,
                  5: ctypes.c_int32, 10: ctypes.c_uint64, 11: ctypes.c_int64}


@functools.cache
def _ggml_base():
    """ggml's base library, beside llama.cpp's (its GGUF parser is not in llama-cpp-python's
    bindings)."""
    from llama_cpp._ctypes_extensions import load_shared_library

    lib = load_shared_library("ggml-base", llama._base_path)
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.gguf_free.restype = None
    lib.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_find_key.restype = ctypes.c_int64
    for getter in (lib.gguf_get_kv_type, lib.gguf_get_arr_type):
        getter.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        getter.restype = ctypes.c_int
    lib.gguf_get_arr_n.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_arr_n.restype = ctypes.c_size_t
    lib.gguf_get_arr_data.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_arr_data.restype = ctypes.c_void_p
    lib.gguf_get_val_str.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_val_str.restype = ctypes.c_char_p
    return lib


class _GgufHeader:
    """A GGUF file's key-value metadata. Each accessor checks a key's type before ggml's getter
    is called: the getters assert it (and an assertion aborts the process)."""

    def __init__(self, path: Path) -> None:
        self._lib = _ggml_base()
        self._ctx = self._lib.gguf_init_from_file(str(path).encode(), _GgufInitParams(True, None))
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp could not read {path}")

    def __enter__(self) -> _GgufHeader:
        return self

    def __exit__(self, *_) -> None:
        self._lib.gguf_free(self._ctx)

    def _key(self, key: str) -> tuple[int, int]:
        """The key's index and type (-1, -1 if the file has none)."""
        index = self._lib.gguf_find_key(self._ctx, key.encode())
        return (index, self._lib.gguf_get_kv_type(self._ctx, index)) if index >= 0 else (-1, -1)

    def string(self, key: str) -> str | None:
        index, kind = self._key(key)
        return self._lib.gguf_get_val_str(self._ctx, index).decode("utf-8", "replace") if kind == _GGUF_STRING else None

    def array_length(self, key: str) -> int | None:
        index, kind = self._key(key)
        return self._lib.gguf_get_arr_n(self._ctx, index) if kind == _GGUF_ARRAY else None

    def integer(self, key: str) -> int | None:
        """A positive integer, or the largest of an array of them (a per-layer value such as
        Gemma 3n's head counts); None where the file has none (the caller's default applies)."""
        index, kind = self._key(key)
        count = 1
        if kind == _GGUF_ARRAY:
            kind, count = self._lib.gguf_get_arr_type(self._ctx, index), self._lib.gguf_get_arr_n(self._ctx, index)
        if kind not in _GGUF_INTEGERS or count == 0:
            return None
        largest = max((_GGUF_INTEGERS[kind] * count).from_address(self._lib.gguf_get_arr_data(self._ctx, index)))
        return largest if largest > 0 else None


def _shards(path: Path) -> list[Path]:
    from fastrun_cpp.hub import shard_names

    return [path.with_name(name) for name in shard_names(path.name) if path.with_name(name).is_file()] or [path]


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a loaded model holds, by part, and where: RAM and, offloaded, GPU memory."""

    weights: int
    kv: int
    compute: int
    prompt_cache: int  # host RAM its saved prefixes may fill (a bound, reached under use)
    on_gpu: bool = False  # weights, KV and compute buffers in GPU memory (per GPU: spread over `gpus`)
    gpus: tuple[int, ...] = ()

    @property
    def ram(self) -> int:
        return self.prompt_cache + (0 if self.on_gpu else self.weights + self.kv + self.compute)

    @property
    def gpu(self) -> int:
        """On each GPU it uses."""
        return (self.weights + self.kv + self.compute) // max(1, len(self.gpus)) if self.on_gpu else 0

    def as_dict(self) -> dict[str, int]:
        return {"weights_bytes": self.weights, "kv_bytes": self.kv, "compute_bytes": self.compute,
                "prompt_cache_bytes": self.prompt_cache, "ram_bytes": self.ram, "gpu_bytes": self.gpu}


def estimate(config: ModelConfig, shape: ModelShape, *, cache_type_k: str, cache_type_v: str,
             on_gpu: bool = False, draft: ModelShape | None = None) -> MemoryNeed:
    """What `config` will hold once loaded. Replicas on the CPU share one copy of the weights;
    each replica has its own KV cache and compute buffers, and one GPU replica per GPU its own
    weights."""
    replicas = config.replica_count
    tokens = config.slots * config.ctx_size
    kv_element = (_KV_TYPE_BYTES[cache_type_k] + _KV_TYPE_BYTES[cache_type_v]) / 2
    kv = int(tokens * shape.n_layer * shape.kv_width * kv_element)
    batch = max(config.batch_size, config.slots)
    # llama.cpp's CPU graph for a full batch: the logits (batch x vocab floats) dominate, then the
    # activations of one layer (a few batch x embd floats), and the output buffer of every slot.
    compute = 4 * (batch * shape.n_vocab + 16 * batch * shape.n_embd + config.slots * shape.n_vocab)
    weights = shape.file_bytes * (len(config.gpus) if on_gpu and config.gpus else 1)
    if draft is not None:  # the draft model's own weights, and its KV per slot
        weights += draft.file_bytes
        kv += int(tokens * draft.n_layer * draft.kv_width * kv_element)
    gpus = tuple(config.gpus or ()) or _gpus_of(config)
    return MemoryNeed(weights=weights, kv=kv * replicas, compute=compute * replicas,
                      prompt_cache=config.prompt_cache_mib * MiB * replicas, on_gpu=on_gpu, gpus=gpus)


def _gpus_of(config: ModelConfig) -> tuple[int, ...]:
    split = config.gpu.tensor_split
    if config.gpu.split_mode != "none" and split:
        return tuple(i for i, share in enumerate(split) if share > 0)
    return (config.gpu.main_gpu,)


def reported(report: BufferReport, need: MemoryNeed) -> MemoryNeed:
    """llama.cpp's account of what it allocated, in the estimate's shape (its prompt cache is
    the configured bound: it is filled later, by use)."""
    by_kind = {"model": 0, "KV": 0, "compute": 0}
    for (device, kind), size in report.bytes.items():
        by_kind["compute" if kind == "output" else kind] += size
    return MemoryNeed(weights=by_kind["model"], kv=by_kind["KV"], compute=by_kind["compute"],
                      prompt_cache=need.prompt_cache, on_gpu=report.total(gpu=True) > 0, gpus=need.gpus)


def larger(a: MemoryNeed, b: MemoryNeed) -> MemoryNeed:
    return MemoryNeed(weights=max(a.weights, b.weights), kv=max(a.kv, b.kv), compute=max(a.compute, b.compute),
                      prompt_cache=max(a.prompt_cache, b.prompt_cache), on_gpu=a.on_gpu or b.on_gpu,
                      gpus=a.gpus or b.gpus)


def process_rss() -> int:
    """This process's resident memory, bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return 0


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


def give_back_freed_memory() -> None:
    """After an unload: collect the cycles that still hold the model's objects (the native
    memory of its grammar tokenizer goes only with them; a full collection may not come for a
    long while), then return the heap's free pages to the system (glibc's malloc_trim)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
