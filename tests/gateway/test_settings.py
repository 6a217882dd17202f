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
