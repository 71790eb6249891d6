"""The attention kernel the deterministic mode admits (patches/llama.cpp: the batch-invariant
tiled kernel, f16 K and V) computes every row the same whatever the batch: a text's logits at
every position are bit for bit the same evaluated whole, one token at a time, in uneven
chunks, or after another sequence's cells and beside it in every batch. On both models:
SmolLM2 (full attention, 3 query heads per KV head) and Gemma 3 (a 512-token sliding window,
4 query heads per KV head; 700 tokens, so the window slides)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest

from fastrun_cpp.runtime.model_runtime import tiled_attention_is_batch_invariant

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not tiled_attention_is_batch_invariant(),
                                reason="llama.cpp built without patches/llama.cpp (make setup applies them)")


def probe(model_path, tokens: int) -> dict[str, list[int]]:
    env = {**os.environ, "GGML_CPU_FA_BATCH_INVARIANT": "1", "GGML_CPU_TILED_MM": "0"}
    result = subprocess.run([sys.executable, "-m", "tests.batch_invariance_probe", str(model_path), str(tokens)],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_attention_rows_do_not_depend_on_the_batch(model, gemma_path):
    from fastrun_cpp.default_model import embedded_model_path

    path, tokens = (embedded_model_path(), 300) if model == "smollm2" else (gemma_path, 700)
    differing = probe(path, tokens)
    assert len(differing) == 3
    assert differing == {way: [] for way in differing}, differing  # positions whose logits differ
