"""`syshax gateway`: the OpenAI-compatible HTTP gateway (FastAPI + uvicorn). Torch-free.

Settings come from the config file (`gateway.*`, `model`, `redis.*`, `queue.max_depth`, ...);
each option below overrides its key for this process.
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    opt = p.add_argument
    opt(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml)",
    )
    opt("--host", default=None, help="address to bind (default: gateway.host, 127.0.0.1)")
    opt("--port", type=int, default=None, help="port to bind (default: gateway.port, 8010)")
    opt(
        "--model",
        default=None,
        help="HF model folder or .gguf file, for the tokenizer and chat template (default: model)",
    )
    opt(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: served_model_name, else derived from the model)",
    )
    opt(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + completion tokens (default: max_model_len)",
    )
    _add_farm_arguments(opt)
    _add_server_arguments(opt)


def _add_farm_arguments(opt) -> None:
    """Where the farm is and what the gateway lets into it."""
    opt("--redis-url", default=None, help="Redis of the farm (default: redis.url)")
    opt("--key-prefix", default=None, help="prefix of every Redis key (default: redis.prefix)")
    opt(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take, queueing included (default: request_timeout)",
    )
    opt(
        "--max-queue-depth",
        type=int,
        default=None,
        help="waiting prefill jobs before new requests get 429 (default: queue.max_depth)",
    )
    opt(
        "--output-ttl",
        type=int,
        default=None,
        help="seconds a request's output is kept for resume (default: output.ttl)",
    )
    opt(
        "--api-key",
        action="append",
        default=None,
        help="accepted API key, repeatable (default: api_keys; none = no authentication)",
    )


def _add_server_arguments(opt) -> None:
    """How the HTTP server treats connections: streams, bodies, stopping, sockets, logs."""
    opt(
        "--disconnect-grace",
        type=float,
        default=0.5,
        help="seconds a dropped stream waits for a resume before it is cancelled (default: %(default)s)",
    )
    opt(
        "--max-body-bytes",
        type=int,
        default=10 * 2**20,
        help="larger request bodies are refused with 413; 0 = no limit (default: %(default)s)",
    )
    opt(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="seconds open streams get to finish on SIGTERM or Ctrl-C (default: shutdown_grace "
        "from the config, 30)",
    )
    opt(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT so several gateway processes share one port (Linux spreads "
        "the connections over them; any of them serves any resume); docs/operations.md, "
        "Scaling out",
    )
    opt(
        "--log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level (default: info; DEBUG=1 -> debug)",
    )


def settings_from_args(args: argparse.Namespace):
    import dataclasses

    from syshax.gateway.settings import GatewaySettings
    from syshax.shared.config import load_config

    settings = GatewaySettings.from_config(load_config(args.config), redis_url=args.redis_url)
    flags = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "max_model_len": args.max_model_len,
        "request_timeout": args.request_timeout,
        "max_queue_depth": args.max_queue_depth,
        "output_ttl": args.output_ttl,
        "api_keys": args.api_key,
        "key_prefix": args.key_prefix,
        "host": args.host,
        "port": args.port,
    }
    return dataclasses.replace(
        settings,
        **{name: value for name, value in flags.items() if value is not None},
        disconnect_grace=args.disconnect_grace,
        shutdown_timeout=(
            settings.shutdown_timeout if args.shutdown_timeout is None else args.shutdown_timeout
        ),
        max_body_bytes=args.max_body_bytes,
    )


def run(args: argparse.Namespace) -> int:
    from syshax.gateway.server import serve
    from syshax.shared.config import ConfigError
    from syshax.shared.tokenizer import TokenizerError

    try:
        settings = settings_from_args(args)
        if not settings.redis_url:
            from syshax.shared import farm_file
            from syshax.shared.config import load_config, resolve_config_path

            cfg = load_config(args.config)
            path = resolve_config_path(args.config)
            settings.redis_url = farm_file.redis_url(None, cfg, path, "gateway")
        if not settings.redis_url:
            from syshax.shared.farm_file import NO_FARM

            raise ValueError(NO_FARM)
        from syshax.shared.config import load_config
        from syshax.shared.logs import apply_log_level

        # --log-level wins; else the config's log_level (DEBUG=1 forces debug).
        level = apply_log_level(args.log_level or load_config(args.config).log_level)
        from syshax.broker.security import open_redis_warning

        warning = open_redis_warning(settings.redis_url)
        if warning:
            logging.getLogger("syshax.gateway").warning("%s", warning)
        serve(settings, log_level=level, reuse_port=args.reuse_port)
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
        return 0
    except (ConfigError, TokenizerError, FileNotFoundError, ValueError) as exc:
        print(f"syshax gateway: error: {exc}", file=sys.stderr)
        return 2
    return 0
