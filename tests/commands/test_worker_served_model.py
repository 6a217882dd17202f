"""`syshax worker` gives every engine it builds the KV identity of its model (docs/engine.md):
the name the worker serves (its jobs' `model`) and the digest of the model file it loads."""

from __future__ import annotations

from syshax.shared.config import Config, set_key
from syshax.shared.models import default_model_path
from syshax.shared.weights_digest import weights_digest
from syshax.workers.accelerator_profiles import load_profile

from syshax.cli import build_parser
from syshax.commands import vllm_setup, worker


def _args(*argv: str):
    return build_parser().parse_args(["worker", *argv])


def test_every_engine_gets_the_workers_served_name_and_its_models_weights(monkeypatch):
    cfg = set_key(Config(), "served_model_name", "farm-model")
    assert worker._served_model(_args(), cfg) == "farm-model"
    weights = weights_digest(default_model_path())
    emulated = worker._build_engine(
        _args("--engine", "emulated"), cfg, "emulated:a10", 2, profile=load_profile("a10")
    )
    assert (emulated.kv_identity.served_model, emulated.kv_identity.weights) == ("farm-model", weights)  # fmt: skip
    echo = worker._build_engine(_args("--engine", "echo"), cfg, "cpu", 2)
    assert echo.kv_identity.served_model == "farm-model"
    seen = {}
    monkeypatch.setattr(vllm_setup, "build_engine", lambda *a: seen.setdefault("args", a))
    worker._build_engine(_args("--engine", "vllm"), cfg, "vllm:cpu", 2)
    assert seen["args"][2:] == (default_model_path(), 2, "farm-model")  # vLLM: passed on


def test_without_served_model_name_the_name_derives_from_the_model():
    """As /v1/models shows it; a worker started with --model derives it from that file."""
    echo = worker._build_engine(_args("--engine", "echo"), Config(), "cpu", 2)
    assert echo.kv_identity.served_model == Config().model_id == "SmolLM2-135M-Instruct"
    args = _args("--model", "/models/Llama-3.2-1B-Q4_K_M.gguf")
    assert worker._served_model(args, Config()) == "Llama-3.2-1B"
