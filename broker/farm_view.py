"""The farm as the dashboard's Farm page shows it, read from Redis with read commands only.

A richer cut of the same state `syshax top` shows (broker/farm_state.py): every work stream
with its length, entries taken and not acked, the age of the oldest of them and its consumers;
the live workers' heartbeats; the dispatcher's recent decisions; the KV leases; the gateways'
delivered inter-token latency tails; the dead letters. Plain JSON-ready dicts, so the page's
endpoint returns them as they are.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import redis

from . import itl_tails
from .dead_letters import list_dead
from .keys import DEVICE_CLASSES, KEYS, Keys
from .liveness import heartbeat_ttl
from .model_state import dispatch_counts, job_streams, model_rows, total_counts
from .schemas import KVHandle, SchemaError
from .text import as_text
from .worker_io import live_workers

if TYPE_CHECKING:
    from .amqp_view import AmqpQueueView  # pika only where the farm's jobs are on RabbitMQ

MAX_LEASES = 50  # leases listed one by one (the totals count them all)
MAX_DEAD = 50


def work_streams(keys: Keys = KEYS, models: tuple[str, ...] = ("",)) -> dict[str, str]:
    """Display name -> stream key of every stream a worker reads. `models`: the stream keys of
    the farm's models (config `models:`; "" = the one model's), each one's named after it."""
    return {name: key for name, (_, key) in job_streams(keys, models).items()}


def _id_age(entry_id: Any, now: float) -> float | None:
    """Seconds since a stream entry id's time (`<ms>-<seq>`): how long ago it was queued."""
    try:
        return round(max(now - int(as_text(entry_id).split("-", 1)[0]) / 1e3, 0.0), 3)
    except (AttributeError, ValueError):
        return None


def streams_view(
    r: redis.Redis,
    keys: Keys = KEYS,
    now: float | None = None,
    models: tuple[str, ...] = ("",),
    amqp: AmqpQueueView | None = None,
) -> list[dict]:
    """Each work stream: length, waiting (not yet taken), pending (taken, not acked), the
    queued age of the oldest pending entry, and its consumers (name, pending, idle seconds).
    `amqp` (`broker.jobs: amqp`): the prefill and decode queues are RabbitMQ's, shown with
    their ready jobs (`transport` rabbitmq; pending and consumers not known: None, [])."""
    now = time.time() if now is None else now
    streams = work_streams(keys, models)
    on_amqp = {k for name, (m, k) in job_streams(keys, models).items()
               if amqp is not None and k != keys.for_model(m).prefill_batch_stream}  # fmt: skip
    pipe = r.pipeline(transaction=False)
    for key in streams.values():
        pipe.xlen(key)
        pipe.xpending(key, keys.decode_group)
        pipe.xinfo_consumers(key, keys.decode_group)
    replies = pipe.execute(raise_on_error=False)
    out = []
    for i, (name, key) in enumerate(streams.items()):
        length, pending, consumers = replies[3 * i : 3 * i + 3]
        length = length if isinstance(length, int) else 0
        pending = pending if isinstance(pending, dict) else {}
        taken = int(pending.get("pending") or 0)
        oldest = _id_age(pending.get("min"), now) if taken else None
        rows = consumers if isinstance(consumers, list) else []
        if key in on_amqp:
            ready = amqp.depth(key)
            out.append({"name": name, "key": key, "transport": "rabbitmq", "length": ready,
                        "waiting": ready, "pending": None, "oldest_pending_age_s": None,
                        "consumers": []})  # fmt: skip
            continue
        out.append(
            {
                "name": name,
                "key": key,
                "transport": "redis",
                "length": length,
                "waiting": max(length - taken, 0),
                "pending": taken,
                "oldest_pending_age_s": oldest,
                "consumers": [
                    {
                        "name": as_text(c.get("name")),
                        "pending": int(c.get("pending") or 0),
                        "idle_s": round(int(c.get("idle") or 0) / 1e3, 1),
                    }
                    for c in rows
                ],
            }
        )
    return out


def _number(info: dict, key: str, default: float = 0.0) -> float:
    try:
        return float(info.get(key, default))
    except (TypeError, ValueError):
        return default


def worker_view(info: dict[str, str], now: float) -> dict:
    """One heartbeat as the page shows it. The step time is the worker's fitted model at its
    running batch (base + per-row cost x rows): what the dispatcher predicts from."""
    running = int(_number(info, "running"))
    step_ms = None
    if "step_base_ms" in info:
        rows = max(running, 1)
        step_ms = round(_number(info, "step_base_ms") + _number(info, "step_row_ms") * rows, 2)
    return {
        "id": info.get("id", "?"),
        "host": info.get("host", ""),
        "device_class": info.get("device_class", ""),
        "device": info.get("device", ""),
        "roles": info.get("roles", ""),
        "engine": info.get("engine", ""),
        "model": info.get("model", ""),
        "running": running,
        "waiting": int(_number(info, "waiting")),
        "capacity": int(_number(info, "capacity")),
        "step_ms": step_ms,
        "step_tail": _number(info, "step_tail", 1.0) if "step_tail" in info else None,
        "decode_tps": _number(info, "decode_tps"),
        "heartbeat_age_s": round(max(now - _number(info, "last_seen", now), 0.0), 2),
        "heartbeat_ttl_s": heartbeat_ttl(info),
        "kv_blocks_held": int(_number(info, "kv_blocks_held")),
        "kv_blocks": int(_number(info, "kv_blocks")),
        "draining": info.get("draining", "0") == "1",
    }


def dispatcher_view(
    r: redis.Redis, keys: Keys = KEYS, count: int = 20, models: tuple[str, ...] = ("",)
) -> dict:
    """The dispatcher's decision counts per device class (every model's summed; `by_model`:
    each one's, in a farm of several) and its last `count` decisions, each split into time,
    device, rule, model (of several; "" else) and reason (`record_dispatch`'s format)."""
    raw = r.lrange(keys.dispatch_log, 0, count - 1)
    counts = dispatch_counts(r, keys, models)
    named = sorted((m for m in models if m), key=len, reverse=True)  # "a-b" before "a"
    decisions = []
    for line in raw:
        stamp, _, rest = as_text(line).partition(" ")
        device, _, what = rest.partition(" ")
        rule = ""
        if what.startswith("[") and "] " in what:
            rule, _, what = what[1:].partition("] ")
        model = next((m for m in named if what.startswith(f"{m}: ")), "")
        try:
            at: float | None = float(stamp)
        except ValueError:
            at = None  # a foreign entry: shown as it is
        reason = what[len(model) + 2 :] if model else what
        decisions.append(
            {"at": at, "device": device, "rule": rule, "model": model, "reason": reason}
        )
    return {
        "counts": total_counts(counts),
        "by_model": {m: c for m, c in counts.items() if m},
        "decisions": decisions,
    }


def leases_view(
    r: redis.Redis, keys: Keys = KEYS, now: float | None = None, ttl: float = 120.0
) -> dict:
    """KV leases: how many, their bytes, and the oldest `MAX_LEASES` one by one (owner, the
    worker that made it, age, seconds to expiry). A lease's age is `ttl` (kv.ttl, the time a
    lease is given) less its time to expiry."""
    now = time.time() if now is None else now
    total = r.zcard(keys.kv_leases)
    ids = [as_text(i) for i in r.zrange(keys.kv_leases, 0, MAX_LEASES - 1)]
    pipe = r.pipeline(transaction=False)  # each lease in its own slot (keys.py): no MGET
    for hid in ids:
        pipe.get(keys.kv_lease(hid))
    raws = pipe.execute() if ids else []
    held, nbytes = [], 0
    for hid, raw in zip(ids, raws, strict=True):
        if raw is None:
            continue
        try:
            h = KVHandle.unpack(raw)
        except SchemaError:
            continue
        nbytes += h.nbytes
        left = h.expires_at - now
        held.append(
            {
                "handle": hid,
                "owner": h.owner,
                "worker": h.created_by,
                "store": h.store,
                "tokens": h.num_tokens,
                "bytes": h.nbytes,
                "age_s": round(max(ttl - left, 0.0), 1),
                "expires_in_s": round(left, 1),
            }
        )
    return {"count": total, "bytes_listed": nbytes, "held": held}


def itl_view(r: redis.Redis, keys: Keys = KEYS, now: float | None = None) -> list[dict]:
    """Every gateway's delivered ITL tail (p99 / p50) per device class, fresh or not, and
    whether the dispatcher still reads it (`itl_tails.MAX_AGE_S`)."""
    now = time.time() if now is None else now
    out = []
    for key, value in sorted(r.hgetall(keys.itl_tails).items()):
        cls, _, gateway = as_text(key).partition(":")
        try:
            ratio_s, gaps_s, at_s = as_text(value).split()
            ratio, gaps, age = float(ratio_s), int(gaps_s), now - float(at_s)
        except ValueError:
            continue
        out.append(
            {
                "device_class": cls,
                "gateway": gateway,
                "ratio": ratio,
                "gaps": gaps,
                "age_s": round(age, 1),
                "fresh": age <= itl_tails.MAX_AGE_S,
            }
        )
    return out


def _per_model(
    models: tuple[str, ...], workers: list[dict], streams: list[dict], counts: dict
) -> dict[str, dict]:
    """A farm of several models: each one's row (model_state.model_rows); {} for one model."""
    if not any(models):
        return {}
    names = job_streams(KEYS, models)  # display name -> (model, key): the names are prefix-free
    waiting = dict.fromkeys(models, 0)
    for st in streams:
        model = names[st["name"]][0] if st["name"] in names else None
        if model is not None:
            waiting[model] += st["waiting"]
    return model_rows(models, workers, counts, waiting)  # worker_view's rows carry its fields


def farm_view(
    r: redis.Redis,
    keys: Keys = KEYS,
    now: float | None = None,
    kv_ttl: float = 120.0,
    models: tuple[str, ...] = ("",),
    amqp: AmqpQueueView | None = None,
) -> dict:
    """Everything the Farm page shows, in one JSON-ready dict (`models`: work_streams';
    `amqp`: the farm's RabbitMQ queues with `broker.jobs: amqp`, streams_view's, and its
    dead-letter queue's count in `rabbitmq_dead`, None without)."""
    now = time.time() if now is None else now
    workers = [
        worker_view(w, now)
        for w in sorted(
            live_workers(r, keys), key=lambda w: (w.get("device_class", ""), w.get("id", ""))
        )
    ]
    dead = list_dead(r, keys, MAX_DEAD, now)
    streams = streams_view(r, keys, now, models, amqp)
    dispatcher = dispatcher_view(r, keys, models=models)
    return {
        "now": now,
        "prefix": keys.prefix,
        "device_classes": list(DEVICE_CLASSES),
        "streams": streams,
        "workers": workers,
        "models": sorted({w["model"] for w in workers if w["model"]}),
        "per_model": _per_model(models, workers, streams, dispatcher["by_model"]),
        "dispatcher": dispatcher,
        "kv": leases_view(r, keys, now, kv_ttl),
        "itl_tails": itl_view(r, keys, now),
        "rabbitmq_dead": amqp.dead_letters() if amqp is not None else None,
        "dead_letters": {
            "length": r.xlen(keys.dead_letter_stream),
            "entries": [d.as_dict() for d in dead],
        },
    }
