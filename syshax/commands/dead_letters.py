"""`syshax dead-letters`: the jobs workers set aside, listed, requeued or dropped.

A worker dead-letters a job it must not run (undecodable, another model's, a KV cache it cannot
import, one its engine failed on): the job is kept with the reason, in the Redis dead-letter
stream, or with `broker.jobs: amqp` in RabbitMQ's dead-letter queue (where RabbitMQ also puts a
job delivered too often); the same actions work on both (broker/job_transport.open_dead_letters).
`requeue ID` puts it back on the stream it came from (broker/dead_letters.py says what changes:
a fresh deadline, a decode job's KV recomputed, the request's error events cleared); `drop ID`
deletes it. Both ask for confirmation unless --yes, and are logged. The same actions are on
the dashboard's Farm page.
"""

from __future__ import annotations

import argparse
import getpass
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        help="config file (default: $SYSHAX_CONFIG or ~/.config/syshax/config.yaml)",
    )
    p.add_argument("--redis-url", default=None, help="Redis of the farm (default: redis.url)")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    what = "list the newest dead letters with their reasons"
    ls = sub.add_parser("list", help=what, description=what)
    ls.add_argument(
        "--count", type=int, default=50, help="how many, newest first (default: %(default)s)"
    )
    actions = (
        (
            "requeue",
            "put back on its own stream, with its time budget again from now (a decode job "
            "recomputes its KV; the request's error events are removed from its output)",
        ),
        ("drop", "delete for good (a decode job's KV lease is freed)"),
    )
    for name, what in actions:
        one = sub.add_parser(name, help=f"a dead letter's job: {what.split(',')[0]}",
                             description=f"A dead letter's job: {what}. Logged.")  # fmt: skip
        one.add_argument("id", help="the dead letter's id (the first column of `list`)")
        one.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def _print_list(letters) -> None:
    if not letters:
        print("no dead letters")
        return
    for d in letters:
        age = f"{d.age_s:.0f}s ago" if d.age_s is not None else "?"
        request = d.request_id or "(undecodable)"
        print(f"{d.id}  {age:>10}  {d.stream}  {request}\n    reason: {d.reason}")


def _confirmed(action: str, letter, assume_yes: bool) -> bool:
    if assume_yes:
        return True
    if not sys.stdin.isatty():
        print(
            f"syshax dead-letters: {action} needs --yes when not run in a terminal", file=sys.stderr
        )
        return False
    what = f"{action} dead letter {letter.id} (request {letter.request_id or '?'}, {letter.reason})"
    return input(f"{what}? [y/N] ").strip().lower() in ("y", "yes")


def run(args: argparse.Namespace) -> int:
    import redis

    from syshax.broker import dead_letters
    from syshax.broker.job_transport import open_dead_letters
    from syshax.commands.farm_access import open_farm

    farm = open_farm(args, "dead-letters")
    if farm is None:
        return 2
    cfg = farm.cfg
    models = tuple(m.key for m in cfg.served_models())
    store = open_dead_letters(
        farm.redis, farm.keys, cfg.broker.jobs, cfg.broker.amqp_url or "", models
    )
    try:
        if args.action == "list":
            _print_list(store.list(args.count))
            return 0
        letter = store.get(args.id)
        if not _confirmed(args.action, letter, args.yes):
            print("nothing done")
            return 1
        do = store.requeue if args.action == "requeue" else store.drop
        do(args.id, who=f"{getpass.getuser()} (cli)")
        print(
            f"{args.id}: "
            + ("requeued on " + letter.stream if args.action == "requeue" else "dropped")
        )
        return 0
    except dead_letters.DeadLetterError as exc:
        print(f"syshax dead-letters: {exc}", file=sys.stderr)
        return 1
    except redis.ConnectionError as exc:  # RabbitMQ's AmqpUnreachable is one too
        amqp = type(exc).__name__ == "AmqpUnreachable"  # pika not imported for a Redis farm
        print(
            f"syshax dead-letters: {'RabbitMQ' if amqp else 'Redis'} unreachable: {exc}",
            file=sys.stderr,
        )
        return 1
    finally:
        store.close()
