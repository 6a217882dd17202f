"""`syshax batch`: offline batches of OpenAI requests as rq jobs (see docs/batch.md).

    syshax batch submit requests.jsonl [--out results.jsonl] [--wait] [--priority N]
    syshax batch status BATCH_ID
    syshax batch results BATCH_ID --out results.jsonl
    syshax batch cancel BATCH_ID
    syshax batch worker [--concurrency N]

`worker` runs N forking rq workers (one request in flight each) under one supervisor that
loads the tokenizer once (the workers and their work horses inherit it), restarts a worker
that dies, runs rq's scheduler (retries with a delay) and the abandoned-job cleanup.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

log = logging.getLogger("syshax.batch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml)",
    )
    common.add_argument("--redis-url", default=None, help="Redis URL (default: redis.url)")
    sub = p.add_subparsers(dest="batch_command", metavar="ACTION", required=True)

    s = sub.add_parser("submit", parents=[common], help="queue a JSONL file of requests")
    s.add_argument("file", help="JSONL: {custom_id, method, url, body} per line (or a bare body)")
    s.add_argument("--out", default=None, help="write the results here at the end (implies --wait)")
    s.add_argument("--wait", action="store_true", help="show progress until every request ended")
    s.add_argument(
        "--priority",
        type=int,
        default=1,
        help="farm priority: >= 1 = batch stream, served only when no interactive request "
        "waits; 0 = the interactive stream (default: %(default)s)",
    )
    s.add_argument(
        "--result-ttl",
        type=int,
        default=7 * 24 * 3600,
        help="seconds results are kept (default: %(default)s)",
    )

    st = sub.add_parser("status", parents=[common], help="counts of a batch's requests per state")
    st.add_argument("batch_id")
    st.add_argument("--json", action="store_true", help="print JSON")

    res = sub.add_parser("results", parents=[common], help="write a batch's results (JSONL)")
    res.add_argument("batch_id")
    res.add_argument("--out", default="-", help="output file; - = stdout (default)")
    res.add_argument("--wait", action="store_true", help="wait until every request ended")
    res.add_argument(
        "--partial", action="store_true", help="write even if some requests have not ended"
    )

    c = sub.add_parser("cancel", parents=[common], help="cancel every request not yet ended")
    c.add_argument("batch_id")

    sub.add_parser("list", parents=[common], help="known batches, newest first")

    w = sub.add_parser("worker", parents=[common], help="run rq workers for the batch queue")
    w.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="rq worker processes = requests in flight from this worker (default: %(default)s)",
    )
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    w.add_argument(
        "--heartbeat", type=int, default=5, help="seconds between job heartbeats (default: 5)"
    )
    w.add_argument(
        "--abandon-after",
        type=int,
        default=15,
        help="seconds after its last heartbeat a job of a dead worker is retried (default: 15)",
    )
    w.add_argument(
        "--maintenance-interval",
        type=int,
        default=10,
        help="seconds between abandoned-job sweeps (default: %(default)s)",
    )
    w.add_argument(
        "--stranded-grace",
        type=float,
        default=20.0,
        help="seconds a job may sit dequeued but not started (its worker or Redis died between "
        "rq's two writes) before it is put back at the front of the queue (default: %(default)s)",
    )
    w.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="seconds running jobs get to finish on SIGTERM before they are requeued (default: 20)",
    )


def _setup(args: argparse.Namespace):
    from syshax.broker.keys import Keys
    from syshax.shared import farm_file
    from syshax.shared.config import load_config, resolve_config_path

    cfg = load_config(args.config)
    from syshax.broker.connect import batch_url

    url = farm_file.redis_url(args.redis_url, cfg, resolve_config_path(args.config), "batch")
    if not url:
        raise ValueError(farm_file.NO_FARM)
    # The farm's Redis may be a cluster; rq's queue needs a single server (batch.redis_url).
    return cfg, url, batch_url(url, cfg.batch.redis_url), Keys(cfg.redis.prefix)


def run(args: argparse.Namespace) -> int:
    import redis

    from syshax.batch import batches
    from syshax.shared.config import ConfigError

    try:
        cfg, url, rq_url, keys = _setup(args)
        if args.batch_command == "worker":
            return _worker(args, cfg, url, rq_url, keys)
        r = redis.Redis.from_url(rq_url)
        return ACTIONS[args.batch_command](args, cfg, r, keys)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"syshax batch: error: {exc}", file=sys.stderr)
        return 2
    except batches.BatchNotFound as exc:
        print(f"syshax batch: no such batch: {exc.args[0]}", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"syshax batch: Redis error: {exc}", file=sys.stderr)
        return 2


# ---- client actions --------------------------------------------------------------------------
def _submit(args, cfg, r, keys) -> int:
    from syshax.batch import batches
    from syshax.batch.lines import parse_lines

    with open(args.file, encoding="utf-8") as fh:
        items = parse_lines(fh)
    bid = batches.submit(
        r,
        items,
        source=os.path.abspath(args.file),
        priority=args.priority,
        keys=keys,
        job_timeout=int(cfg.request_timeout) + 60,
        result_ttl=args.result_ttl,
    )
    bad = [i for i in items if i.error]
    for item in bad:
        print(f"{args.file}:{item.line}: {item.error}", file=sys.stderr)
    print(bid)
    print(
        f"queued {len(items) - len(bad)} request(s), {len(bad)} invalid line(s) in batch {bid}",
        file=sys.stderr,
    )
    if not (args.wait or args.out):
        return 1 if bad else 0
    st = _wait(r, bid, keys)
    if args.out:
        _write_results(r, bid, keys, args.out)
    return 0 if st["failed"] == st["cancelled"] == 0 else 1


def _wait(r, bid: str, keys, poll: float = 1.0) -> dict[str, Any]:
    """Show done/failed/remaining until every request of the batch ended."""
    from tqdm import tqdm

    from syshax.batch import batches

    st = batches.status(r, bid, keys)
    with tqdm(total=st["total"], desc=bid, unit="req", file=sys.stderr, disable=None) as bar:
        while True:
            ended = st["finished"] + st["failed"] + st["cancelled"]
            bar.n = ended
            postfix = {"done": st["finished"], "failed": st["failed"]}
            postfix.update(cancelled=st["cancelled"], remaining=st["total"] - ended)
            bar.set_postfix(postfix, tokens=st["tokens"], refresh=False)
            bar.refresh()
            if st["complete"]:
                break
            time.sleep(poll)
            st = batches.status(r, bid, keys)
    print(_summary(st), file=sys.stderr)
    return st


def _summary(st: dict[str, Any]) -> str:
    return (
        f"{st['id']}: {st['total']} total, {st['finished']} finished, {st['failed']} failed "
        f"({st['invalid']} invalid lines), {st['cancelled']} cancelled, {st['queued']} queued, "
        f"{st['started']} running; {st['tokens']} tokens generated"
    )


def _write_results(r, bid: str, keys, out: str) -> int:
    from syshax.batch import batches

    n = 0
    fh = sys.stdout if out == "-" else open(out, "w", encoding="utf-8")  # noqa: SIM115
    try:
        for _, _, line in batches.results(r, bid, keys):
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
    finally:
        if fh is not sys.stdout:
            fh.close()
    if out != "-":
        print(f"wrote {n} result(s) to {out}", file=sys.stderr)
    return n


def _status(args, cfg, r, keys) -> int:
    from syshax.batch import batches

    st = batches.status(r, args.batch_id, keys)
    print(json.dumps(st) if args.json else _summary(st))
    return 0


def _results(args, cfg, r, keys) -> int:
    from syshax.batch import batches

    st = _wait(r, args.batch_id, keys) if args.wait else batches.status(r, args.batch_id, keys)
    if not st["complete"] and not args.partial:
        print(
            f"syshax batch: {st['queued'] + st['started']} request(s) not ended yet "
            "(--wait waits, --partial writes anyway)",
            file=sys.stderr,
        )
        return 1
    _write_results(r, args.batch_id, keys, args.out)
    return 0


def _cancel(args, cfg, r, keys) -> int:
    from syshax.batch import batches

    c = batches.cancel(r, args.batch_id, keys)
    print(f"{args.batch_id}: cancelled {c['cancelled']} waiting, stopping {c['stopping']} running")
    return 0


def _list(args, cfg, r, keys) -> int:
    from syshax.batch import batches

    for raw in r.zrevrange(keys.batches, 0, -1):
        bid = raw.decode()
        try:
            print(_summary(batches.status(r, bid, keys)))
        except batches.BatchNotFound:
            r.zrem(keys.batches, bid)  # expired
    return 0


ACTIONS = {
    "submit": _submit,
    "status": _status,
    "results": _results,
    "cancel": _cancel,
    "list": _list,
}


# ---- the worker ------------------------------------------------------------------------------
def _worker(args, cfg, url: str, rq_url: str, keys) -> int:
    """rq workers on `rq_url` whose jobs run on the farm at `url`."""
    import redis

    from syshax.shared.logs import apply_log_level

    apply_log_level(cfg.log_level)
    from rq.registry import clean_registries
    from rq.scheduler import RQScheduler

    from syshax.batch import batches, jobs
    from syshax.batch.farm_client import FarmClient, settings_from_config
    from syshax.batch.stranded import StrandedJobs
    from syshax.commands.supervisor import Child, Supervisor

    if args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # we fork after loading it
    jobs.set_client(FarmClient.from_settings(settings_from_config(cfg, url)))
    r = redis.Redis.from_url(rq_url)
    queue = batches.batch_queue(r, keys)
    scheduler = RQScheduler(
        [queue], connection=r, logging_level=logging.WARNING, serializer=jobs.SERIALIZER
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # SIGTERM = rq's warm shutdown (finish the running job); after --drain-timeout a second
    # SIGTERM = cold shutdown (the horse is killed and its job retried later); SIGKILL 10 s on.
    steps = ((signal.SIGTERM, args.drain_timeout), (signal.SIGTERM, 10.0))
    workers = [
        Child(
            f"rq-worker-{i}",
            target=_work,
            args=(rq_url, keys.batch_queue, args),
            stop_steps=steps,
            restart_on_success=not args.burst,  # burst: exit 0 = the queue is empty
        )
        for i in range(args.concurrency)
    ]
    supervisor = Supervisor(workers, logger=log, context="fork")  # the workers inherit the client
    next_clean = 0.0
    stranded = StrandedJobs(args.stranded_grace)

    def maintain() -> None:
        nonlocal next_clean
        try:
            scheduler.acquire_locks()  # retries wait in rq's scheduled registry
            if scheduler.acquired_locks:
                scheduler.enqueue_scheduled_jobs()
            if time.monotonic() >= next_clean:  # jobs of dead workers -> Retry
                next_clean = time.monotonic() + args.maintenance_interval
                if queue.acquire_maintenance_lock():
                    try:
                        clean_registries(queue)
                        for job_id in stranded.sweep(queue):  # taken, never started: Redis died
                            log.warning("batch job %s was left dequeued but not started; requeued", job_id)  # fmt: skip
                    finally:
                        queue.release_maintenance_lock()
        except redis.RedisError as exc:  # Redis restarting: the rq workers wait too
            log.warning("Redis unavailable (%s); retrying", exc)

    print(
        f"batch worker: {args.concurrency} rq worker(s) on queue {keys.batch_queue}",
        file=sys.stderr,
        flush=True,
    )
    try:
        supervisor.start()
        supervisor.run(stop, tick=maintain)
    finally:
        supervisor.stop()
        if scheduler.acquired_locks:
            scheduler.release_locks()
    return 0


def _work(url: str, queue_name: str, args: argparse.Namespace) -> None:
    """One rq worker process (forks a work horse per job)."""
    import redis

    from syshax.batch.rq_worker import BatchWorker
    from syshax.shared import env

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # rq installs its own in work()
    w = BatchWorker(
        [queue_name],
        connection=redis.Redis.from_url(url),
        job_monitoring_interval=args.heartbeat,
        maintenance_interval=args.maintenance_interval,
    )
    w.abandon_after = args.abandon_after
    try:
        w.work(burst=args.burst, logging_level="DEBUG" if env.debug() else "WARNING")
    except redis.ConnectionError as exc:  # Redis went away: the supervisor starts us again
        log.warning("rq worker: Redis unavailable (%s); exiting to be restarted", exc)
        sys.exit(1)
