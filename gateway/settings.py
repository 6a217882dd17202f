"""What the gateway needs to know, in one small dataclass (built from the farm's Config)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from syshax.shared.config import derive_model_name
from syshax.shared.models import GGUF_MAGIC, default_model_path, read_gguf_metadata

DEFAULT_MAX_MODEL_LEN = 2048  # when neither the settings nor the model say less


@dataclass
class GatewaySettings:
    model: str = "default"  # HF model folder or .gguf file; "default" = SmolLM2-135M-Instruct
    served_model_name: str | None = None  # the `model` clients send; None = from the model path
    max_model_len: int | None = None  # None = min(model's context length, 2048)
    request_timeout: float = 600.0  # seconds a request may take, queueing included
    max_queue_depth: int = 256  # prefill jobs waiting; more -> 429
    output_ttl: int = 600  # seconds a request's output stream is kept (resume window)
    api_keys: list[str] = field(default_factory=list)  # empty = no authentication
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "syshax"
    host: str = "127.0.0.1"
    port: int = 8000
    poll_interval: float = 0.5  # seconds of pub/sub silence before reading the output stream
    disconnect_grace: float = 0.5  # seconds a dropped stream waits for a resume before cancel
    shutdown_timeout: float = 30.0  # seconds open streams get to finish on SIGTERM
    retry_after: int = 1  # seconds, for 429/503 responses
    max_body_bytes: int = 10 * 2**20  # larger request bodies get 413 (0 = no limit)

    def model_path(self) -> Path:
        return default_model_path() if self.model in ("", "default") else Path(self.model)

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        # The one derivation config, check-config and /v1/models share (".Q4_K_M" stripped).
        return derive_model_name(self.model or "default")

    def resolved_max_model_len(self) -> int:
        if self.max_model_len:
            return int(self.max_model_len)
        native = model_context_length(self.model_path())
        return min(native, DEFAULT_MAX_MODEL_LEN) if native else DEFAULT_MAX_MODEL_LEN


def model_context_length(path: Path) -> int | None:
    """The context length the model was trained for, from GGUF metadata or config.json."""
    try:
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if (path / "config.json").is_file():
                config = json.loads((path / "config.json").read_text(encoding="utf-8"))
                value = config.get("max_position_embeddings")
                return int(value) if value else None
            if len(ggufs) != 1:
                return None
            path = ggufs[0]
        with open(path, "rb") as fh:
            if fh.read(4) != GGUF_MAGIC:
                return None
        meta = read_gguf_metadata(path)
        arch = meta.get("general.architecture", "llama")
        value = meta.get(f"{arch}.context_length")
        return int(value) if value else None
    except (OSError, ValueError):
        return None
