"""`syshax check-config`: load and check the config file; exit 1 when anything is wrong."""

from __future__ import annotations

import argparse
import sys

from syshax.commands.config import add_config_option
from syshax.shared import env
from syshax.shared.config import (
    ConfigError,
    load_config,
    redact_url,
    resolve_config_path,
    validate,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_option(p)


def run(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"syshax check-config: error: {exc}", file=sys.stderr)
        return 1
    exists = path.exists()
    if exists:
        print(f"config: {path}")
    else:
        # Nothing was read: say so first, and the path only as where `syshax init` would write.
        print(f"config: no config file; using the built-in defaults (`syshax init` writes one at {path})")  # fmt: skip
    for m in cfg.served_models():  # the one model, or each of `models:`
        c = m.config
        try:
            print(f"model: {c.model} -> {c.model_path()} (served as {c.model_id})")
        except FileNotFoundError:
            print(f"model: {c.model} -> not found (served as {c.model_id})")
    from syshax.workers.checks import check_workers

    workers = check_workers(cfg)  # what the workers will run, and what keeps them from it
    for line in workers.lines:
        print(line)
    print(_dispatch_line(cfg))
    if cfg.redis.url:
        print(f"redis: {redact_url(cfg.redis.url)}")
    else:
        print("redis: embedded (`syshax run` starts a Redis server on a free port)")
    problems = validate(cfg)
    for reader in env.ENV_VARS.values():
        try:
            reader()
        except env.EnvError as exc:
            problems.append(f"environment: {exc}")
    problems += workers.problems
    if problems:
        print(f"{len(problems)} problem(s):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"config OK: {path}" if exists else "config OK: the built-in defaults (no config file)")
    return 0


def _dispatch_line(cfg) -> str:
    device = cfg.decode_device
    if not cfg.auto_pd_offload:
        device = "xpu (auto_pd_offload false)"
    slo = "none" if cfg.slo.itl_ms is None else f"{cfg.slo.itl_ms:g} ms"
    used = "" if device == "auto" or cfg.slo.itl_ms is None else " (used with decode_device auto)"
    return f"decodes: decode_device {device}; inter-token latency SLO {slo}{used}"
