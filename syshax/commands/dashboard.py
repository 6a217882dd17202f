"""`syshax dashboard`: rq-dashboard (batch queue, jobs, workers, failures) and the Farm page
(streams, workers, dispatcher, KV leases, ITL tails, dead letters; syshax/farm_page/) in one
app on the farm's Redis.

Binds 127.0.0.1:9181 by default. HTTP basic auth is on when a password is configured
(--password, or $RQ_DASHBOARD_PASSWORD), and always when it binds beyond loopback: with none
configured, a password is generated and shown once on stderr (the dashboard can cancel and
requeue jobs, so nobody else on the network may reach it unauthenticated). One check covers
both pages, their JSON and their actions. Jobs are read with the farm's JSON serializer
(batch jobs are never pickled).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml)",
    )
    p.add_argument("--redis-url", default=None, help="Redis URL (default: redis.url)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: %(default)s); beyond loopback basic auth is required "
        "(a password is generated and shown once when none is given)",
    )
    p.add_argument("--port", type=int, default=9181, help="port to bind (default: %(default)s)")
    p.add_argument(
        "--username",
        default=None,
        help="basic-auth user (default: $RQ_DASHBOARD_USERNAME, else admin when a password is set)",
    )
    p.add_argument(
        "--password",
        default=None,
        help="basic-auth password (default: $RQ_DASHBOARD_PASSWORD); none = no authentication "
        "on loopback, a generated password (shown once) on any other address; prefer the "
        "environment variable: a --password is visible to every local user in ps",
    )
    p.add_argument("--url-prefix", default="", help="URL prefix behind a reverse proxy")
    p.add_argument(
        "--poll-ms",
        type=int,
        default=1000,
        help="how often the pages refresh themselves, in milliseconds (default: %(default)s)",
    )


def credentials(args: argparse.Namespace) -> tuple[str, str]:
    """(username, password) of the dashboard's basic auth; ("", "") = none (loopback only)."""
    from syshax.shared import env as environment
    from syshax.shared.net import is_loopback

    password = args.password or environment.rq_dashboard_password() or ""
    username = args.username or environment.rq_dashboard_username() or ""
    if username and not password:
        raise ValueError("--username needs a password (--password or $RQ_DASHBOARD_PASSWORD)")
    if not password and not is_loopback(args.host):
        password = secrets.token_urlsafe(12)
        print(
            f"syshax dashboard: {args.host} is reachable from other hosts: basic auth as "
            f"{username or 'admin'} with the generated password {password} (shown once; set "
            "RQ_DASHBOARD_PASSWORD to choose one)",
            file=sys.stderr,
            flush=True,
        )
    return (username or "admin", password) if password else ("", "")


def run(args: argparse.Namespace) -> int:
    from syshax.broker.keys import Keys
    from syshax.shared.config import ConfigError, load_config, redact_url

    try:
        from syshax.shared import farm_file
        from syshax.shared.config import resolve_config_path

        cfg = load_config(args.config)
        url = farm_file.redis_url(
            args.redis_url, cfg, resolve_config_path(args.config), "dashboard"
        )
        if not url:
            raise ValueError(farm_file.NO_FARM)
        username, password = credentials(args)
        from syshax.farm_page import FarmPageSettings, make_app
    except (ConfigError, ValueError) as exc:
        print(f"syshax dashboard: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"syshax dashboard: rq-dashboard is not installed ({exc})", file=sys.stderr)
        return 2
    settings = FarmPageSettings(
        redis_url=url,
        keys=Keys(cfg.redis.prefix),
        kv_ttl=cfg.kv.ttl,
        username=username,
        password=password,
        url_prefix=args.url_prefix.rstrip("/"),
        poll_ms=args.poll_ms,
        models=tuple(m.key for m in cfg.served_models()),
        jobs=cfg.broker.jobs,
        amqp_url=cfg.broker.amqp_url or "",
    )
    app = make_app(settings)
    # Dead-letter actions are logged (who, which job, what it was); Flask's request lines not.
    logging.getLogger("syshax.broker.dead_letters").setLevel(logging.INFO)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    auth = f"basic auth as {username}" if password else "no authentication"
    base = f"http://{args.host}:{args.port}{settings.url_prefix}"
    print(
        f"dashboard on {base}/ (rq's pages) and {base}/farm/ (the Farm page) for "
        f"{redact_url(url)} ({auth})",
        file=sys.stderr,
        flush=True,
    )
    try:
        app.run(host=args.host, port=args.port, threaded=True)
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        print(f"syshax dashboard: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
