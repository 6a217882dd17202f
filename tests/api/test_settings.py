"""The settings every client of the farm shares: the served model name is the one `syshax
config` and `check-config` show, and a batch worker reads the Config as the gateway does."""

from __future__ import annotations

from dataclasses import fields

from syshax.api.settings import ApiSettings
from syshax.gateway.settings import GatewaySettings
from syshax.shared.config import Config, set_key


def test_served_name_drops_the_quantization_suffix_like_the_config_does() -> None:
    for model in ("/m/Llama-3.2-1B-Instruct.Q4_K_M.gguf", "/m/qwen2.5-7b-instruct-q4_0.gguf"):
        cfg = Config(model=model)
        assert ApiSettings(model=model).model_name() == cfg.model_id
    assert ApiSettings(model="/m/Llama-3.2-1B-Instruct.Q4_K_M.gguf").model_name() == (
        "Llama-3.2-1B-Instruct"
    )
    assert ApiSettings().model_name() == "SmolLM2-135M-Instruct" == Config().model_id
    assert ApiSettings(model="/models/Llama-3.2-1B/").model_name() == "Llama-3.2-1B"
    assert ApiSettings(model="x.gguf", served_model_name="mine").model_name() == "mine"


def test_a_batch_client_reads_the_config_as_the_gateway_does() -> None:
    cfg = Config()
    for key, text in {"model": "/m/x.gguf", "max_model_len": "512", "request_timeout": "7",
                      "output.ttl": "9", "redis.url": "redis://h:1/2", "redis.prefix": "pfx",
                      "limits.stop_strings": "3"}.items():  # fmt: skip
        cfg = set_key(cfg, key, text)
    api, gateway = ApiSettings.from_config(cfg), GatewaySettings.from_config(cfg)
    for f in fields(ApiSettings):
        assert getattr(api, f.name) == getattr(gateway, f.name), f.name
    assert api.limits.stop_strings == 3 and api.redis_url == "redis://h:1/2"
    assert ApiSettings.from_config(cfg, redis_url="redis://o:2/0").redis_url == "redis://o:2/0"
    assert ApiSettings.from_config(Config()).redis_url == ""  # embedded: the farm file says
