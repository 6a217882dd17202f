"""The gateway's routes of a farm of several models (config `models:`): a request's `model`
picks its tokenizer, checks and job streams; an unknown one is OpenAI's 404."""

from __future__ import annotations

import pytest
from syshax.api.errors import APIError
from syshax.api.settings import ApiSettings
from syshax.broker.keys import Keys
from syshax.gateway.model_routes import Router, build_routes
from syshax.shared.config import Config
from syshax.shared.config_models import ModelEntry


def test_routes_of_several_models() -> None:
    cfg = Config(
        models=[
            ModelEntry(model="default", served_model_name="a"),
            ModelEntry(model="default", served_model_name="b", max_model_len=512),
        ]
    )
    router = Router(build_routes(ApiSettings.from_config(cfg, "redis://unused"), Keys("p")))
    a, b = router.routes
    assert router.pick(None) is a and router.pick("a") is a and router.pick("b") is b
    assert b.keys.prefill_stream == "{p}:model:b:stream:prefill"
    assert (a.max_model_len, b.max_model_len) == (2048, 512)
    assert a.tokenizer is b.tokenizer  # one file: its tokenizer loaded once
    assert router.of_name("b") is b and router.of_name("gone") is a  # a resume's stored model
    with pytest.raises(APIError) as info:
        router.pick("c")
    assert info.value.status == 404
    assert info.value.body()["error"]["code"] == "model_not_found"
    assert [c["id"] for c in router.cards(None)] == ["a", "b"]
    assert [c["id"] for c in router.cards({"b", "other"})] == ["b"]  # live ones only


def test_one_model_keeps_the_plain_streams_and_its_names() -> None:
    router = Router(build_routes(ApiSettings.from_config(Config(), "redis://unused"), Keys("p")))
    (only,) = router.routes
    assert only.key == "" and only.keys.prefill_stream == "{p}:stream:prefill"
    assert router.pick("SmolLM2-135M-Instruct") is only and router.pick("default") is only
    assert router.job_streams() == {
        "prefill": "{p}:stream:prefill",
        "prefill:batch": "{p}:stream:prefill:batch",
        "decode:xpu": "{p}:stream:decode:xpu",
        "decode:cpu": "{p}:stream:decode:cpu",
    }
