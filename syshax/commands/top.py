"""`syshax top`: a live terminal view of the farm (workers, queues, dispatcher decisions)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml)",
    )
    p.add_argument("--redis-url", default=None, help="Redis of the farm (default: redis.url)")
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between refreshes (default: %(default)s)",
    )
    p.add_argument(
        "--once",
        action="store_true",
        help="print one snapshot and exit (for scripts and screenshots)",
    )


def snapshot(r, keys, models: tuple[str, ...] = ("",), amqp=None) -> dict:
    """`models`: the stream keys of the farm's models ("" = a one-model farm's streams);
    `amqp`: its RabbitMQ queues (broker/amqp_view.AmqpQueueView) with `broker.jobs: amqp`."""
    from syshax.broker.farm_state import snapshot as farm_snapshot

    return farm_snapshot(r, keys, models, amqp)


def render(snap: dict):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    workers = Table(title="workers", expand=True)
    several = bool(snap.get("models"))  # a farm of several models: which each worker serves
    cols = ("id", *(("model",) if several else ()), "class", "device", "roles", "running/capacity", "waiting", "decode tok/s", "spec accept", "tok/step")  # fmt: skip
    for col in cols:
        workers.add_column(col)
    for w in snap["workers"]:
        workers.add_row(
            w.get("id", "?"),
            *((w.get("model", "?"),) if several else ()),
            w.get("device_class", "?"),
            w.get("device", "?"),
            w.get("roles", "?"),
            f"{w.get('running', 0)}/{w.get('capacity', 0)}",
            w.get("waiting", "0"),
            w.get("decode_tps", "0"),
            _spec(w),
            w.get("spec_tokens_per_step", "-"),
        )
    queues = Table(title="queues (waiting / in flight)", expand=True)
    for col in snap["queues"]:
        queues.add_column(col)
    # "-": a RabbitMQ queue's jobs taken and not acked are not known (broker/amqp_view.py)
    queues.add_row(*(f"{w} / {'-' if f is None else f}" for w, f in snap["queues"].values()))
    leases, nbytes = snap["kv"]
    counts = snap["counts"]
    recent = Table(
        title=f"dispatcher: {counts['xpu']} to xPU, {counts['cpu']} to CPU; KV leases held: {leases} ({nbytes / 2**20:.1f} MiB)",
        expand=True,
    )
    recent.add_column("recent decisions (newest first)")
    for d in snap["decisions"]:
        stamp, _, rest = d.partition(" ")
        with contextlib.suppress(ValueError):  # a foreign entry keeps its raw stamp
            stamp = time.strftime("%H:%M:%S", time.localtime(float(stamp)))
        recent.add_row(Text(f"{stamp} {rest}"))  # plain text: "[slo]" is no markup tag
    return Group(
        workers, *_models_table(snap.get("models") or {}), queues, recent, _dead_table(snap),
        *_rabbitmq_dead(snap),
    )  # fmt: skip


def _rabbitmq_dead(snap: dict) -> list:
    """With `broker.jobs: amqp`: how many letters RabbitMQ's dead-letter queue holds (counted,
    not read: reading a queue takes its messages; `syshax dead-letters list` reads them)."""
    from rich.text import Text

    count = snap.get("rabbitmq_dead")
    if count is None:
        return []
    if not count:
        return [Text("dead letters on RabbitMQ: none")]
    return [Text(f"dead letters on RabbitMQ: {count} (syshax dead-letters list | requeue ID | drop ID)")]  # fmt: skip


DEAD_HINT = "syshax dead-letters requeue ID | drop ID (list: syshax dead-letters list)"


def _dead_table(snap: dict):
    """The dead letters: how many, the newest few with their reasons, and the command that
    requeues or drops one (top only shows; acting asks for a confirmation there)."""
    from rich.table import Table
    from rich.text import Text

    dead = snap.get("dead_letters") or {"count": 0, "newest": []}
    if not dead["count"]:
        return Text("dead letters: none")
    shown = len(dead["newest"])
    newest = f", newest {shown}" if shown < dead["count"] else ""
    table = Table(title=f"dead letters: {dead['count']}{newest}", caption=DEAD_HINT, expand=True)
    for col in ("id", "age", "stream", "request", "reason"):
        table.add_column(col)
    for d in dead["newest"]:
        age = f"{d.age_s:.0f}s" if d.age_s is not None else "?"
        # Text, not markup: a reason may hold "[...]" that rich would read as a style tag.
        table.add_row(d.id, age, d.stream, d.request_id or "(undecodable)", Text(d.reason))
    return table


def _models_table(models: dict) -> list:
    """A farm of several models: each one's workers, its sequences (running + waiting) over
    its decode capacity per device class, the jobs waiting on its streams and its dispatcher's
    decisions per class (broker/model_state.model_rows). Each model's dispatcher weighs only
    its own workers: one model's full xPU does not send another's decodes to the CPU."""
    from rich.table import Table

    if not models:
        return []
    table = Table(title="models (sequences running + waiting / decode capacity)", expand=True)
    for col in ("model", "workers", "xPU", "CPU", "jobs waiting", "dispatched xPU / CPU"):
        table.add_column(col)
    for name, row in sorted(models.items()):
        devices = row.get("devices") or {}
        per_class = [
            f"{d['running'] + d['waiting']} / {d['capacity']}" if d["decoders"] else "-"
            for d in (devices.get(c) for c in ("xpu", "cpu"))
            if d is not None
        ]
        dispatch = row.get("dispatch") or {}
        table.add_row(
            name or "?",
            str(row["workers"]),
            *per_class,
            str(row.get("jobs_waiting", 0)),
            f"{dispatch.get('xpu', 0)} / {dispatch.get('cpu', 0)}",
        )
    return [table]


def _spec(w: dict) -> str:
    """A worker's speculative acceptance as a percentage; "-" when it never speculated."""
    try:
        rate = float(w.get("spec_acceptance", 0))
    except ValueError:
        return "?"
    return f"{rate:.0%}" if rate else "-"


def run(args: argparse.Namespace) -> int:
    import redis
    from rich.console import Console
    from rich.live import Live

    from syshax.commands.farm_access import open_farm

    farm = open_farm(args, "top")
    if farm is None:
        return 2
    cfg, r, keys = farm
    models = tuple(m.key for m in cfg.served_models())
    amqp = None
    if cfg.broker.jobs == "amqp":  # the job queues' depths are RabbitMQ's
        from syshax.broker.amqp_view import AmqpQueueView

        amqp = AmqpQueueView(keys, cfg.broker.amqp_url or "")
    console = Console()
    try:
        if args.once:
            console.print(render(snapshot(r, keys, models, amqp)))
            return 0
        with Live(
            render(snapshot(r, keys, models, amqp)),
            console=console,
            refresh_per_second=4,
            screen=False,
        ) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(snapshot(r, keys, models, amqp)))
    except redis.ConnectionError as exc:  # RabbitMQ's AmqpUnreachable is one too
        what = "RabbitMQ" if type(exc).__name__ == "AmqpUnreachable" else "Redis"
        print(f"syshax top: {what} unreachable: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if amqp is not None:
            amqp.close()
