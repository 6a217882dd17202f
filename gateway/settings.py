"""What the gateway needs to know, in one small dataclass (`GatewaySettings.from_config`): the
settings every client of the farm has (`syshax.api.settings.ApiSettings`) and its HTTP side."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from syshax.api.settings import ApiSettings
from syshax.shared.config import Config

# The defaults this dataclass shares with the farm's Config are read from it, so a bare
# GatewaySettings() (tests, library use) and `syshax gateway` with no config file agree.
_CFG = Config()


@dataclass
class GatewaySettings(ApiSettings):
    max_queue_depth: int = _CFG.queue.max_depth  # prefill jobs waiting; more -> 429
    api_keys: list[str] = field(default_factory=list)  # empty = no authentication
    host: str = _CFG.gateway.host
    port: int = _CFG.gateway.port
    poll_interval: float = 0.5  # seconds of pub/sub silence before reading the output stream
    disconnect_grace: float = 0.5  # seconds a dropped stream waits for a resume before cancel
    shutdown_timeout: float = float(_CFG.shutdown_grace)  # seconds streams get to finish on stop
    retry_after: int = 1  # seconds, for 429/503 responses
    max_body_bytes: int = 10 * 2**20  # larger request bodies get 413 (0 = no limit)
    sse_keepalive: float = _CFG.gateway.sse_keepalive  # seconds of stream silence -> SSE comment

    @classmethod
    def from_config(cls, cfg: Config, redis_url: str | None = None) -> GatewaySettings:
        """The gateway's settings for a farm Config: every key the gateway reads. redis_url
        overrides redis.url; "" when neither is set (the caller looks up the farm file)."""
        api = ApiSettings.from_config(cfg, redis_url)
        return cls(
            **{f.name: getattr(api, f.name) for f in fields(ApiSettings)},
            max_queue_depth=cfg.queue.max_depth,
            api_keys=list(cfg.api_keys),
            host=cfg.gateway.host,
            port=cfg.gateway.port,
            sse_keepalive=cfg.gateway.sse_keepalive,
            shutdown_timeout=float(cfg.shutdown_grace),
        )
