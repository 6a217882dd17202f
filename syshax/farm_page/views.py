"""The Farm page's routes: the page, its JSON (polled by the page), and the dead-letter actions.

The actions are POSTs that must carry the `X-Syshax-Action` header the page's script sends
after the operator confirms: a form on another site cannot set a header, and a cross-site
script cannot send one without a CORS preflight this app never answers; so a page elsewhere
cannot requeue or drop through a browser that is logged in here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from flask import Blueprint, current_app, jsonify, render_template, request, url_for

from syshax.broker import dead_letters
from syshax.broker.connect import SyncClient, sync_client
from syshax.broker.farm_view import farm_view

from .app import FarmPageSettings

log = logging.getLogger(__name__)
ACTION_HEADER = "X-Syshax-Action"

farm = Blueprint(
    "farm",
    __name__,
    template_folder="templates",
    static_folder="static",
    static_url_path="/static",
)


def _settings() -> FarmPageSettings:
    return current_app.config["FARM_PAGE"]


def _redis() -> SyncClient:
    """One client per app (a connection pool), made on first use."""
    client = current_app.extensions.get("farm_redis")
    if client is None:
        client = sync_client(_settings().redis_url, socket_connect_timeout=2, socket_timeout=5)
        current_app.extensions["farm_redis"] = client
    return client


def _no_store(payload: Any, status: int = 200):
    response = jsonify(payload)
    response.status_code = status
    response.headers["Cache-Control"] = "no-store"
    return response


@farm.route("/")
def page():
    s = _settings()
    rq_root = url_for("rq_dashboard.queues_overview")  # "/" or "<prefix>/": rq's first instance
    return render_template(
        "farm_page/farm.html",
        state_url=url_for("farm.state"),
        action_url=url_for("farm.dead_action", entry_id="ENTRY", action="ACTION"),
        rq_queues=rq_root,
        rq_jobs=f"{rq_root}0/view/jobs",
        rq_workers=f"{rq_root}0/view/workers",
        poll_ms=s.poll_ms,
        prefix=s.keys.prefix,
        action_header=ACTION_HEADER,
    )


_amqp_lock = threading.Lock()  # one pika connection per app: not thread-safe, requests are


def _amqp():
    """With `broker.jobs: amqp`, the farm's RabbitMQ queues (read-only; one per app)."""
    s = _settings()
    if s.jobs != "amqp":
        return None
    view = current_app.extensions.get("farm_amqp")
    if view is None:
        from syshax.broker.amqp_view import AmqpQueueView

        view = current_app.extensions["farm_amqp"] = AmqpQueueView(s.keys, s.amqp_url)
    return view


@farm.route("/state.json")
def state():
    s = _settings()
    try:
        with _amqp_lock:
            return _no_store(
                farm_view(_redis(), s.keys, kv_ttl=s.kv_ttl, models=s.models, amqp=_amqp())
            )
    except redis.RedisError as exc:  # RabbitMQ's AmqpUnreachable is one too
        what = "RabbitMQ" if type(exc).__name__ == "AmqpUnreachable" else "Redis"
        return _no_store({"error": f"{what} unreachable: {exc}"}, 503)


@farm.route("/dead/<entry_id>/<action>", methods=["POST"])
def dead_action(entry_id: str, action: str):
    if action not in ("requeue", "drop"):
        return _no_store({"error": f"unknown action {action!r} (requeue, drop)"}, 404)
    if request.headers.get(ACTION_HEADER) != action:
        return _no_store(
            {"error": f"refused: the {ACTION_HEADER} header must name the action (the page's "
             "confirmation sends it)"},
            403,
        )  # fmt: skip
    s = _settings()
    auth = request.authorization
    who = f"{auth.username if auth else 'anonymous'}@{request.remote_addr}"
    do = dead_letters.requeue if action == "requeue" else dead_letters.drop
    try:
        letter = do(_redis(), entry_id, s.keys, who=who)
    except dead_letters.DeadLetterError as exc:
        return _no_store({"error": str(exc)}, 409)
    except redis.RedisError as exc:
        return _no_store({"error": f"Redis unreachable: {exc}"}, 503)
    done = "requeued on " + letter.stream if action == "requeue" else "dropped"
    return _no_store({"ok": True, "action": action, "id": letter.id, "message": done})
