"""The gateway's served model name is the one `syshax config` and `check-config` show."""

from __future__ import annotations

from syshax.gateway.settings import GatewaySettings
from syshax.shared.config import Config


def test_served_name_drops_the_quantization_suffix_like_the_config_does() -> None:
    for model in ("/m/Llama-3.2-1B-Instruct.Q4_K_M.gguf", "/m/qwen2.5-7b-instruct-q4_0.gguf"):
        cfg = Config(model=model)
        assert GatewaySettings(model=model).model_name() == cfg.model_id
    assert GatewaySettings(model="/m/Llama-3.2-1B-Instruct.Q4_K_M.gguf").model_name() == (
        "Llama-3.2-1B-Instruct"
    )
    assert GatewaySettings().model_name() == "SmolLM2-135M-Instruct" == Config().model_id
    assert GatewaySettings(model="/models/Llama-3.2-1B/").model_name() == "Llama-3.2-1B"
    assert GatewaySettings(model="x.gguf", served_model_name="mine").model_name() == "mine"


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
    "host": "conductor.host",
    "port": "conductor.port",
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
        "conductor.host": "0.0.0.0",
        "conductor.port": "9100",
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
