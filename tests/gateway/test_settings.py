"""The gateway's settings carry every key it reads from the farm's Config (the served model
name: tests/api/test_settings.py)."""

from __future__ import annotations

from syshax.gateway.settings import GatewaySettings
from syshax.shared.config import Config

# GatewaySettings field -> the dotted config key it is built from
FROM_CONFIG = {
    "model": "model",
    "served_model_name": "served_model_name",
    "max_model_len": "max_model_len",
    "request_timeout": "request_timeout",
    "max_queue_depth": "queue.max_depth",
    "output_ttl": "output.ttl",
    "api_keys": "api_keys",
    "redis_url": "redis.url",
    "key_prefix": "redis.prefix",
    "host": "gateway.host",
    "port": "gateway.port",
}


def test_from_config_carries_every_key_the_gateway_reads() -> None:
    from syshax.shared.config import get_key, set_key

    cfg = Config()
    for key, text in {
        "model": "/m/x.gguf",
        "served_model_name": "mine",
        "max_model_len": "512",
        "request_timeout": "7",
        "queue.max_depth": "3",
        "output.ttl": "9",
        "api_keys": "k1,k2",
        "redis.url": "redis://h:1/2",
        "redis.prefix": "pfx",
        "gateway.host": "0.0.0.0",
        "gateway.port": "9100",
    }.items():
        cfg = set_key(cfg, key, text)
    settings = GatewaySettings.from_config(cfg)
    for name, key in FROM_CONFIG.items():
        assert getattr(settings, name) == get_key(cfg, key), name
    assert isinstance(settings.request_timeout, float)
    assert settings.api_keys is not cfg.api_keys  # a copy: the app may not change the config
    assert GatewaySettings.from_config(cfg, redis_url="redis://o:2/0").redis_url == "redis://o:2/0"
    assert GatewaySettings.from_config(Config()).redis_url == ""  # embedded: the farm file says


def test_bare_defaults_agree_with_the_config_defaults() -> None:
    from syshax.shared.config import get_key

    bare, cfg = GatewaySettings(), Config()
    for name, key in FROM_CONFIG.items():
        if name not in ("max_model_len", "redis_url"):  # None = from the model; a local Redis
            assert getattr(bare, name) == get_key(cfg, key), name
