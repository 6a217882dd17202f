"""What a job costs on each job transport (`broker.jobs`): Redis streams vs RabbitMQ quorum
queues, the RabbitMQ queues read by polling (basic.get, `amqp`) or pushed to the worker
(basic.consume with a prefetch, `amqp-push`, what the workers do), one job at a time (latency,
not throughput), in one run, rounds alternating.

A job's life as the farm lives it: the gateway queues a prefill job (XADD / a publish waited on
for its confirm), a worker takes it, hands its decode job over (one MULTI / a confirmed publish,
the handed-off mark, the ack), a decoder takes the decode job (on RabbitMQ: with the owner mark
that drops duplicates) and acks it. Redis is an embedded server of its own; RabbitMQ is the one
at --amqp-url (a single node: a cluster's quorum adds its replication round trips).

    .venv/bin/python bench/job_transport.py --jobs 300 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from syshax.broker.amqp_connection import (
    DEFAULT_AMQP_URL,
    dead_letter_exchange,
    job_streams,
    queue_name,
)
from syshax.broker.connect import sync_client
from syshax.broker.embedded import EmbeddedRedis
from syshax.broker.job_transport import WorkerJobs
from syshax.broker.keys import Keys
from syshax.broker.schemas import DecodeJob, PrefillJob
from tqdm import tqdm

STEPS = ("submit", "take prefill", "hand over", "take decode", "ack")
TRANSPORTS = ("redis", "amqp", "amqp-push")
PREFETCH = 8  # a worker's slots: what its own queues push it at most (workers/streams.py)


def one_round(r, transport: str, url: str, jobs: int) -> dict[str, list[float]]:
    """Seconds per step of `jobs` jobs, one after the other, on fresh queues."""
    keys = Keys(f"bench{uuid.uuid4().hex[:8]}")
    kind, prefetch = ("amqp", PREFETCH) if transport == "amqp-push" else (transport, 0)
    worker = WorkerJobs(r, keys, "w1", kind, url)
    gateway = WorkerJobs(r, keys, "gw", kind, url)  # its own connection, as a gateway's
    prefill = worker.queues([keys.prefill_stream], prefetch)
    decode = worker.queues([keys.decode_stream("cpu")], prefetch)
    prefill.ensure_groups()
    decode.ensure_groups()
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    for i in range(jobs):
        rid = f"r{i}"
        job = PrefillJob(request_id=rid, prompt_ids=list(range(64)), params={}).pack()
        decode_job = DecodeJob(request_id=rid, prompt_ids=list(range(64)), output_ids=[1]).pack()
        t = [time.perf_counter()]
        if gateway.amqp is not None:
            gateway.amqp.publish(keys.prefill_stream, job)
        else:
            r.xadd(keys.prefill_stream, {"j": job})
        t.append(time.perf_counter())
        (entry,) = prefill.read(1, 1000)
        t.append(time.perf_counter())
        prefill.hand_over(entry, keys.decode_stream("cpu"), decode_job)
        t.append(time.perf_counter())
        (taken,) = decode.read(1, 1000)
        t.append(time.perf_counter())
        decode.ack(taken)
        t.append(time.perf_counter())
        for k, step in enumerate(STEPS):
            times[step].append(t[k + 1] - t[k])
    if worker.amqp is not None:
        _delete(worker, keys)
    worker.close()
    gateway.close()
    return times


def proc_cpu(pid: str) -> float:
    """CPU seconds (user + system) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cost(r, url: str, seconds: float, prefetch: int = 0) -> tuple[float | None, float]:
    """(RabbitMQ's CPU %, the worker's CPU %) while a worker with nothing to do waits on its
    two queues: polling them (basic.get has no blocking form) or, `prefetch` > 0, blocked on
    its consumers; RabbitMQ's is None when its process is not found here (pgrep beam.smp)."""
    pid = _beam_pid()
    keys = Keys(f"bench{uuid.uuid4().hex[:8]}")
    worker = WorkerJobs(r, keys, "w1", "amqp", url)
    queues = worker.queues([keys.decode_stream("cpu"), keys.prefill_stream], prefetch)
    beam0, me0, t0 = proc_cpu(pid) if pid else 0.0, time.process_time(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        queues.read(1, 100)  # the worker's idle read
    wall = time.monotonic() - t0
    beam = (proc_cpu(pid) - beam0) / wall * 100 if pid else None
    me = (time.process_time() - me0) / wall * 100
    _delete(worker, keys)
    worker.close()
    return beam, me


def _beam_pid() -> str | None:
    """RabbitMQ's Erlang VM on this machine (its CPU time is read from /proc), else None."""
    found = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True)
    return found.stdout.split()[0] if found.stdout.split() else None


def _delete(worker: WorkerJobs, keys: Keys) -> None:
    ch = worker.amqp.channel
    for s in job_streams(keys):
        ch.queue_delete(queue_name(s))
    ch.queue_delete(dead_letter_exchange(keys))
    ch.exchange_delete(dead_letter_exchange(keys))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=300, help="jobs per round (default 300)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per transport (default 3)")
    ap.add_argument(
        "--amqp-url", default=DEFAULT_AMQP_URL, help=f"RabbitMQ (default {DEFAULT_AMQP_URL})"
    )
    ap.add_argument(
        "--idle-seconds",
        type=float,
        default=5.0,
        help="seconds an idle worker polls RabbitMQ for the idle cost (0 = skip; default 5)",
    )
    args = ap.parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {t: {s: [] for s in STEPS} for t in TRANSPORTS}
    # CPU seconds per transport (load-independent, unlike the latencies): RabbitMQ's (its
    # beam.smp, when found here) and this process's (the client side: pika or redis-py).
    beam_pid = _beam_pid()
    cpu = {t: {"rabbitmq": 0.0, "client": 0.0} for t in TRANSPORTS}
    with EmbeddedRedis() as server:
        r = sync_client(server.url)
        order = [t for _ in range(args.rounds) for t in TRANSPORTS]
        for transport in tqdm(order, desc="rounds (alternating)"):
            beam0, me0 = proc_cpu(beam_pid) if beam_pid else 0.0, time.process_time()
            got = one_round(r, transport, args.amqp_url, args.jobs)
            cpu[transport]["client"] += time.process_time() - me0
            cpu[transport]["rabbitmq"] += (proc_cpu(beam_pid) - beam0) if beam_pid else 0.0
            for step, values in got.items():
                results[transport][step] += values
    print(f"machine: {platform.node()} {platform.machine()}, python {platform.python_version()}")
    print(f"load average before the report: {os.getloadavg()[0]:.1f}")
    print(f"{args.jobs} jobs x {args.rounds} rounds per transport, one job at a time, rounds alternating")  # fmt: skip
    print(f"{'step':<14}" + "".join(f"{t + ' p50 us':>18}" for t in TRANSPORTS)
          + "".join(f"{t + ' p99':>16}" for t in TRANSPORTS))  # fmt: skip
    total = dict.fromkeys(TRANSPORTS, 0.0)
    for step in STEPS:
        p50s, p99s = [], []
        for t in TRANSPORTS:
            v = sorted(results[t][step])
            p50s.append(statistics.median(v) * 1e6)
            p99s.append(v[int(len(v) * 0.99) - 1] * 1e6)
            total[t] += p50s[-1]
        print(f"{step:<14}" + "".join(f"{x:>18.0f}" for x in p50s)
              + "".join(f"{x:>16.0f}" for x in p99s))  # fmt: skip
    print(f"{'a job (sum)':<14}" + "".join(f"{total[t]:>18.0f}" for t in TRANSPORTS))
    n = args.jobs * args.rounds
    for side in ("rabbitmq", "client"):
        if side == "rabbitmq" and not beam_pid:
            print("RabbitMQ CPU per job: not measured (no beam.smp here)")
            continue
        row = "".join(f"{cpu[t][side] / n * 1e6:>18.0f}" for t in TRANSPORTS)
        print(f"{side + ' CPU us/job':<14}" + row)
    if args.idle_seconds > 0:
        for name, prefetch in (("polling (basic.get)", 0), ("pushed (basic.consume)", PREFETCH)):
            with EmbeddedRedis() as server:
                beam, me = idle_cost(
                    sync_client(server.url), args.amqp_url, args.idle_seconds, prefetch
                )
            shown = f"{beam:.1f}%" if beam is not None else "not measured (no beam.smp here)"
            print(f"an idle worker, {name}: RabbitMQ CPU {shown}, the worker's CPU {me:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
