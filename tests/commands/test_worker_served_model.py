"""`syshax worker` gives every engine it builds the KV identity of its model (docs/engine.md):
the name the worker serves (its jobs' `model`) and the digest of the model file it loads.
(Settings: workers/settings.py; engines: workers/build.py.)"""

from __future__ import annotations

import dataclasses

from syshax.shared.config import Config, set_key
from syshax.shared.default_model import default_model_path
from syshax.shared.weights_digest import weights_digest
from syshax.workers.build import build_engine
from syshax.workers.settings import WorkerOverrides, WorkerSettings
from syshax.workers.vllm import setup as vllm_setup

from syshax.cli import build_parser


def _settings(cfg: Config, *argv: str) -> WorkerSettings:
    args = build_parser().parse_args(["worker", *argv])
    return WorkerSettings.from_config(cfg, WorkerOverrides.of(args))


def test_every_engine_gets_the_workers_served_name_and_its_models_weights(monkeypatch):
    cfg = set_key(Config(), "served_model_name", "farm-model")
    assert _settings(cfg).served_model == "farm-model"
    weights = weights_digest(default_model_path())
    emulated = build_engine(_settings(cfg, "--engine", "emulated", "--profile", "a10"))
    assert (emulated.kv_identity.served_model, emulated.kv_identity.weights) == ("farm-model", weights)  # fmt: skip
    echo = build_engine(_settings(cfg, "--engine", "echo", "--max-batch-size", "2"))
    assert echo.kv_identity.served_model == "farm-model"
    seen = {}
    monkeypatch.setattr(vllm_setup, "build_engine", lambda *a: seen.setdefault("args", a))
    # vLLM itself is not installed here: its settings as a vLLM worker's would be
    o = WorkerOverrides(engine="vllm", max_batch_size=2)
    vllm = dataclasses.replace(
        _settings(cfg, "--engine", "echo", "--max-batch-size", "2"),
        engine="vllm",
        vllm=vllm_setup.worker_args(cfg, o, 2),
    )
    build_engine(vllm)
    path, args, served = seen["args"]  # vLLM: passed on
    assert (path, args.max_num_seqs, served) == (default_model_path(), 2, "farm-model")


def test_without_served_model_name_the_name_derives_from_the_model():
    """As /v1/models shows it; a worker started with --model derives it from that file."""
    echo = build_engine(_settings(Config(), "--engine", "echo", "--max-batch-size", "2"))
    assert echo.kv_identity.served_model == Config().model_id == "SmolLM2-135M-Instruct"
    worker = _settings(Config(), "--engine", "echo", "--model", "/models/Llama-3.2-1B-Q4_K_M.gguf")
    assert worker.served_model == "Llama-3.2-1B"
