"""The kernels the deterministic mode admits (patches/llama.cpp: the batch-invariant tiled
attention kernel, f16 K and V; Q4_K weights repacked for the kernels whose one-row path computes
a row as the many-row path does) compute every row the same whatever the batch: a text's logits
at every position are bit for bit the same evaluated whole, one token at a time, in uneven
chunks, or after another sequence's cells and beside it in every batch. On both models:
SmolLM2 (Q4_1, full attention, 3 query heads per KV head) and Gemma 3 (Q4_K_M, its Q4_K weights
repacked; a 512-token sliding window, 4 query heads per KV head; 700 tokens, so the window slides)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from fastrun_cpp.engine.backend import system_info
from fastrun_cpp.runtime.model_runtime import repacked_q4_k_is_batch_invariant, tiled_attention_is_batch_invariant

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not tiled_attention_is_batch_invariant(),
                                reason="llama.cpp built without patches/llama.cpp (make setup applies them)")


def probe(model_path, tokens: int) -> tuple[dict[str, list[int]], str]:
    """The positions whose logits differ, by way of evaluating, and llama.cpp's log."""
    env = {**os.environ, "GGML_CPU_FA_BATCH_INVARIANT": "1", "GGML_CPU_TILED_MM": "0",
           "GGML_CPU_REPACK_BATCH_INVARIANT": "1"}  # the deterministic mode's switches (prepare_process)
    result = subprocess.run([sys.executable, "-m", "tests.batch_invariance_probe", str(model_path), str(tokens)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_rows_do_not_depend_on_the_batch(model, gemma_path):
    from fastrun_cpp.default_model import embedded_model_path

    path, tokens = (embedded_model_path(), 300) if model == "smollm2" else (gemma_path, 700)
    differing, log = probe(path, tokens)
    assert len(differing) == 3
    assert differing == {way: [] for way in differing}, differing  # positions whose logits differ
    if model == "gemma3" and repacked_q4_k_is_batch_invariant() and "AVX2 = 1" in system_info():
        # Its Q4_K weights did take the repacked kernels (one-row and many-row) checked above.
        assert "CPU_REPACK model buffer size" in log, log[-2000:]
