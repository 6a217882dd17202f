"""The bundled model as an HF folder (vLLM reads only those), converted once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory) -> Path:
    from syshax.shared.default_model import default_model_path
    from syshax.workers.engine.hf_export import export_hf

    out = tmp_path_factory.mktemp("vllm") / "smollm2"
    export_hf(default_model_path(), out, dtype="float32", progress=False)
    return out
