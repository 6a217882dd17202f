"""Each model of a farm of several (config `models:`) as `syshax top` and the Farm page show it:
its live workers, its sequences and decode capacity per device class, the jobs waiting on its
own streams and the dispatcher's decisions for it. Read commands only.

A model's dispatcher runs in its own prefill workers over its own workers and streams
(`live_workers` with the model's keys), so its decisions and capacity are its own: one model
filling its xPU does not push another's decodes to the CPU. These rows show that split.
"""

from __future__ import annotations

import redis

from .keys import DEVICE_CLASSES, Keys


def job_streams(keys: Keys, models: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Display name -> (model, stream key) of every job stream of the farm's `models` (the
    stream keys: "" = the one-model farm's streams, named as they always were)."""
    streams: dict[str, tuple[str, str]] = {}
    for model in models:
        k, name = keys.for_model(model), f"{model} " if model else ""
        streams[f"{name}prefill"] = (model, k.prefill_stream)
        streams[f"{name}prefill:batch"] = (model, k.prefill_batch_stream)
        for c in DEVICE_CLASSES:
            streams[f"{name}decode:{c}"] = (model, k.decode_stream(c))
    return streams


def dispatch_counts(
    r: redis.Redis, keys: Keys, models: tuple[str, ...]
) -> dict[str, dict[str, int]]:
    """Model -> device class -> decisions that sent a decode there (`record_dispatch`'s
    counters: each model of several counts its own, keys.dispatch_count)."""
    pipe = r.pipeline(transaction=False)  # all in the farm's slot; read only
    for model in models:
        for c in DEVICE_CLASSES:
            pipe.get(keys.for_model(model).dispatch_count(c))
    replies = iter(pipe.execute(raise_on_error=False))
    return {model: {c: _int(next(replies)) for c in DEVICE_CLASSES} for model in models}


def total_counts(counts: dict[str, dict[str, int]]) -> dict[str, int]:
    """The farm's decisions per device class: every model's summed."""
    return {c: sum(per[c] for per in counts.values()) for c in DEVICE_CLASSES}


def _int(value: object) -> int:
    try:
        return int(value or 0)  # type: ignore[call-overload]
    except (TypeError, ValueError):  # an error reply (raise_on_error=False) or a foreign value
        return 0


def _device_row() -> dict[str, int]:
    return {"decoders": 0, "running": 0, "waiting": 0, "capacity": 0}


def model_rows(
    models: tuple[str, ...],
    workers: list[dict],
    counts: dict[str, dict[str, int]],
    jobs_waiting: dict[str, int],
) -> dict[str, dict]:
    """Served model -> its row: `workers` (live), `load` (sequences running + waiting in its
    workers), `capacity` (decode sequences at once), `devices` (per class: decode workers,
    running, waiting, capacity), `jobs_waiting` (entries on its streams no worker took yet)
    and `dispatch` (decisions per class). `models`: the config's stream keys; a worker whose
    model the config does not list (a stale config) gets a row too, without queue or counts."""
    rows: dict[str, dict] = {}

    def row(model: str) -> dict:
        return rows.setdefault(
            model,
            {
                "workers": 0,
                "load": 0,
                "capacity": 0,
                "devices": {c: _device_row() for c in DEVICE_CLASSES},
                "jobs_waiting": jobs_waiting.get(model, 0),
                "dispatch": dict(counts.get(model) or dict.fromkeys(DEVICE_CLASSES, 0)),
            },
        )

    for model in models:
        row(model)
    for w in workers:
        r = row(w.get("model", ""))
        running, waiting = _int(w.get("running")), _int(w.get("waiting"))
        r["workers"] += 1
        r["load"] += running + waiting
        device = r["devices"].get(w.get("device_class", ""))
        if "decode" not in w.get("roles", "").split(",") or device is None:
            continue
        capacity = _int(w.get("capacity"))
        r["capacity"] += capacity
        device["decoders"] += 1
        device["running"] += running
        device["waiting"] += waiting
        device["capacity"] += capacity
    return rows
