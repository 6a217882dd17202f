"""What any client of the farm needs to turn OpenAI requests into jobs and to reach the farm:
the gateway (`GatewaySettings` adds its HTTP side) and a batch worker (`ApiSettings` alone)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from syshax.shared.config import Config, derive_model_name
from syshax.shared.config_schema import LimitsConfig
from syshax.shared.default_model import default_model_path
from syshax.shared.gguf_reader import GGUF_MAGIC, read_gguf_metadata

# The defaults this dataclass shares with the farm's Config are read from it, so a bare
# ApiSettings() (tests, library use) and a farm with no config file agree.
_CFG = Config()
DEFAULT_MAX_MODEL_LEN = _CFG.max_model_len  # when neither the settings nor the model say less


@dataclass
class ApiSettings:
    model: str = _CFG.model  # HF model folder or .gguf file; "default" = SmolLM2-135M-Instruct
    served_model_name: str | None = None  # the `model` clients send; None = from the model path
    # None = min(model's context length, DEFAULT_MAX_MODEL_LEN); the Config always sets a number
    max_model_len: int | None = None
    request_timeout: float = float(_CFG.request_timeout)  # seconds, queueing included
    output_ttl: int = _CFG.output.ttl  # seconds a request's output stream is kept (resume)
    # The Config's null redis.url means "the embedded Redis `syshax run` starts", which only the
    # farm file can name; a bare ApiSettings talks to a local Redis instead.
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = _CFG.redis.prefix
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # per-request bounds
    # A farm of several models (config `models:`): (stream key, model, served name, max_model_len)
    # of each, the default first; empty = the one model above, on the farm's plain streams.
    served: tuple[tuple[str, str, str, int], ...] = ()
    jobs: str = _CFG.broker.jobs  # where prefill jobs are queued: redis | amqp
    amqp_url: str = ""  # broker.amqp_url ("": RabbitMQ's default local URL)

    @classmethod
    def from_config(cls, cfg: Config, redis_url: str | None = None) -> ApiSettings:
        """The settings for a farm Config. redis_url overrides redis.url; "" when neither is
        set (the caller looks up the farm file)."""
        return cls(
            model=cfg.model,
            served_model_name=cfg.served_model_name,
            max_model_len=cfg.max_model_len,
            request_timeout=float(cfg.request_timeout),
            output_ttl=cfg.output.ttl,
            redis_url=redis_url or cfg.redis.url or "",
            key_prefix=cfg.redis.prefix,
            limits=cfg.limits,
            served=_served(cfg),
            jobs=cfg.broker.jobs,
            amqp_url=cfg.broker.amqp_url or "",
        )

    def per_model(self) -> list[tuple[str, ApiSettings]]:
        """(stream key, settings) of every model these settings serve, the default first."""
        if not self.served:
            return [("", self)]
        return [
            (key, replace(self, model=model, served_model_name=name, max_model_len=n, served=()))
            for key, model, name, n in self.served
        ]

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


def _served(cfg: Config) -> tuple[tuple[str, str, str, int], ...]:
    if not cfg.models:
        return ()
    return tuple(
        (m.key, m.config.model, m.config.model_id, m.config.max_model_len)
        for m in cfg.served_models()
    )


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
