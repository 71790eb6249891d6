"""Log probabilities of sampled tokens: the log-softmax of the model's raw logits; and the view
of llama.cpp's logits every sampling path reads."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def logits_view(logits, n_vocab: int) -> np.ndarray:
    """llama.cpp's logits at one output row (a float pointer, or a ctypes float array), as a
    writable numpy view (no copy). Per token, so it matters: np.ctypeslib.as_array takes about
    4 us a call, this about 1 us."""
    address = ctypes.addressof(logits.contents if isinstance(logits, ctypes._Pointer) else logits)
    return np.frombuffer((ctypes.c_float * n_vocab).from_address(address), dtype=np.float32)


def token_logprob(logits_ptr: ctypes.POINTER(ctypes.c_float), n_vocab: int, token: int, top_n: int) -> TokenLogprob:
    """Logprob of `token` and the `top_n` most likely tokens at one position.

    Uses the raw logits (before penalties, temperature or truncation), as OpenAI does.
    """
    logits = logits_view(logits_ptr, n_vocab)
    peak = logits.max()
    log_normalizer = float(peak) + float(np.log(np.exp(logits - peak, dtype=np.float32).sum(dtype=np.float64)))
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        candidates = np.argpartition(logits, n_vocab - top_n)[n_vocab - top_n:]
        candidates = candidates[np.argsort(-logits[candidates], kind="stable")]
        top = tuple((int(i), float(logits[i]) - log_normalizer) for i in candidates)
    return TokenLogprob(token, float(logits[token]) - log_normalizer, top)
