"""The batch tests' farm config: the session's Redis, short contexts and timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from syshax.shared.config import Config, save_config


@pytest.fixture
def config(tmp_path: Path, redis_url: str) -> Path:
    cfg = Config()
    cfg.redis.url = redis_url
    cfg.max_model_len = 512
    cfg.request_timeout = 60
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    return path
