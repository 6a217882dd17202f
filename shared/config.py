"""The sysHAX configuration: the YAML file `syshax init` writes, key access and its checks.

The schema (sections, each key's default, type, value rule and one-line doc) is the pydantic
models in `config_schema.py`. The rest is one module per job, re-exported here (every command,
the gateway and the workers import the config from this module):

* `config_values.py`: values by dotted key (`get_key`, `parse_value`, `set_key`, `format_value`);
* `config_file.py`: the file (`resolve_config_path`, `load_config`, `save_config`);
* `config_problems.py`: the whole-config checks (`validate`: port collisions, the model, the
  Redis URL, besides every value) and `redact_url`.

The key table drives `set_key`, `validate`, the comments `save_config` writes and `syshax config
--help`, so they cannot disagree. Torch-free and Redis-free: the CLI, the gateway and every
worker import it.
"""

from __future__ import annotations

import os
from typing import Any

from .config_check import check
from .config_file import default_config_path, load_config, resolve_config_path, save_config
from .config_problems import REDIS_SCHEMES, model_problem, redact_url, redis_url_problem, validate
from .config_schema import (
    DTYPES,
    KEY_DOCS,
    KV_STORES,
    LOG_LEVELS,
    SECTION_DOCS,
    Config,
    ConfigError,
    CpuConfig,
    GatewayConfig,
    KVConfig,
    OutputConfig,
    QueueConfig,
    RedisConfig,
    SloConfig,
    XpuConfig,
    derive_model_name,
)
from .config_values import config_keys, format_value, get_key, parse_value, set_key

__all__ = [
    "DTYPES",
    "KEY_DOCS",
    "KV_STORES",
    "LOG_LEVELS",
    "REDIS_SCHEMES",
    "SECTION_DOCS",
    "GatewayConfig",
    "Config",
    "ConfigError",
    "CpuConfig",
    "XpuConfig",
    "KVConfig",
    "OutputConfig",
    "QueueConfig",
    "RedisConfig",
    "SloConfig",
    "config_from_dict",
    "config_keys",
    "default_config_path",
    "derive_model_name",
    "format_value",
    "get_key",
    "load_config",
    "model_problem",
    "parse_value",
    "redact_url",
    "redis_url_problem",
    "resolve_config_path",
    "resolve_threads",
    "save_config",
    "set_key",
    "validate",
]


def config_from_dict(data: dict[str, Any]) -> Config:
    """A Config from a nested dict (as YAML gives); missing keys keep their defaults. Raises
    ConfigError listing every unknown key and bad value."""
    cfg, problems = check(data)
    if problems:
        raise ConfigError("\n".join(f"{k}: {m}" for k, m in problems), problems)
    return cfg


def resolve_threads(threads: int | None) -> int:
    """A `threads` setting made concrete: null = half the usable cores, at least 1."""
    if threads:
        return threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2)
