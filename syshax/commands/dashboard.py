"""`syshax dashboard`: rq-dashboard (batch queue, jobs, workers, failures) on the farm's Redis.

Binds 127.0.0.1:9181 by default. HTTP basic auth is on when a password is configured
(--password, or $RQ_DASHBOARD_PASSWORD), and always when it binds beyond loopback: with none
configured, a password is generated and shown once on stderr (the dashboard can cancel and
requeue jobs, so nobody else on the network may reach it unauthenticated). The password is
handed to rq-dashboard through its environment variable, never on a command line that `ps`
would show. Jobs are read with the farm's JSON serializer (batch jobs are never pickled).
"""

from __future__ import annotations

import argparse
import os
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


def dashboard_argv(args: argparse.Namespace, url: str) -> tuple[list[str], dict[str, str]]:
    """rq-dashboard's arguments and the environment variables to set (the credentials)."""
    argv = ["--bind", args.host, "--port", str(args.port), "--redis-url", url, "--json"]
    if args.url_prefix:
        argv += ["--url-prefix", args.url_prefix]
    env: dict[str, str] = {}
    from syshax.shared import env as environment

    password = args.password or environment.rq_dashboard_password() or ""
    username = args.username or environment.rq_dashboard_username() or ""
    if username and not password:
        raise ValueError("--username needs a password (--password or $RQ_DASHBOARD_PASSWORD)")
    from syshax.shared.net import is_loopback

    if not password and not is_loopback(args.host):
        password = secrets.token_urlsafe(12)
        print(
            f"syshax dashboard: {args.host} is reachable from other hosts: basic auth as "
            f"{username or 'admin'} with the generated password {password} (shown once; set "
            "RQ_DASHBOARD_PASSWORD to choose one)",
            file=sys.stderr,
            flush=True,
        )
    if password:
        env = {"RQ_DASHBOARD_USERNAME": username or "admin", "RQ_DASHBOARD_PASSWORD": password}
    return argv, env


def run(args: argparse.Namespace) -> int:
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
        argv, env = dashboard_argv(args, url)
        from rq_dashboard.cli import run as dashboard
    except (ConfigError, ValueError) as exc:
        print(f"syshax dashboard: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"syshax dashboard: rq-dashboard is not installed ({exc})", file=sys.stderr)
        return 2
    for key in ("RQ_DASHBOARD_USERNAME", "RQ_DASHBOARD_PASSWORD"):
        os.environ.pop(key, None)
    os.environ.update(env)
    auth = f"basic auth as {env['RQ_DASHBOARD_USERNAME']}" if env else "no authentication"
    print(
        f"rq-dashboard on http://{args.host}:{args.port}{args.url_prefix}/ for "
        f"{redact_url(url)} ({auth})",
        file=sys.stderr,
        flush=True,
    )
    try:
        dashboard.main(args=argv, prog_name="syshax dashboard", auto_envvar_prefix="RQ_DASHBOARD")
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        return 0
    return 0
