"""What the embedded Redis's persistence costs per streamed token (issue 27).

Starts the farm's embedded Redis (broker/farm_redis.py: unix socket, ACL user, maxmemory) with
its append-only file as shipped (fsync every second), with `appendfsync no`, and without an
AOF, and drives the token-delivery pipeline a worker sends per step (XADD to the request's
output stream with MAXLEN ~, EXPIRE, PUBLISH; `--batch` tokens per pipeline) for `--tokens`
tokens. Prints the server's own CPU time per token (INFO cpu: the cost that competes with the
engine for the host's cores) and the client's wall-clock rate, alternating the modes for
`--rounds` rounds (these machines are noisy).

    python bench/redis_persistence.py --tokens 100000 --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from syshax.broker.farm_redis import FarmRedis
from syshax.shared.private_files import write_private

MODES = {
    "aof everysec (shipped)": {},
    "aof, fsync no": {"appendfsync everysec": "appendfsync no"},
    "no aof": {"appendonly yes": "appendonly no"},
}


def measure(changes: dict[str, str], tokens: int, batch: int, streams: int) -> tuple[float, float]:
    """(server CPU microseconds per token, tokens per second at the client)."""
    with tempfile.TemporaryDirectory() as tmp:
        server = FarmRedis(Path(tmp) / "farm")
        conf = server.conf()
        for old, new in changes.items():
            assert old in conf, old
            conf = conf.replace(old, new)
        write_private(server.conf_path, conf)
        proc = subprocess.Popen(server.argv())
        try:
            server.wait_ready(alive=lambda: proc.poll() is None)
            r = server.client()
            payload = b"x" * 120  # about a packed TokenEvent
            before, t0 = r.info("cpu"), time.perf_counter()
            for i in range(0, tokens, batch):
                pipe = r.pipeline(transaction=False)
                for j in range(batch):
                    rid = f"req-{(i + j) % streams}"
                    pipe.xadd(f"syshax:out:{rid}", {"e": payload}, maxlen=2048, approximate=True)
                    pipe.expire(f"syshax:out:{rid}", 600)
                    pipe.publish(f"syshax:tokens:{rid}", payload)
                pipe.execute()
            wall, after = time.perf_counter() - t0, r.info("cpu")
        finally:
            proc.terminate()
            proc.wait()
    cpu = sum(after[k] - before[k] for k in ("used_cpu_sys", "used_cpu_user"))
    return cpu / tokens * 1e6, tokens / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tokens", type=int, default=100_000, help="tokens per measurement")
    p.add_argument("--batch", type=int, default=16, help="tokens per pipeline (a step's streams)")
    p.add_argument("--streams", type=int, default=64, help="distinct requests written to")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of every mode")
    args = p.parse_args()
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode, changes in MODES.items():
            results[mode].append(measure(changes, args.tokens, args.batch, args.streams))
    print(f"{'mode':<24} {'Redis CPU us/token (each round)':<36} {'client tok/s (each round)'}")
    for mode, runs in results.items():
        cpu = ", ".join(f"{c:.1f}" for c, _ in runs)
        rate = ", ".join(f"{t:,.0f}" for _, t in runs)
        print(f"{mode:<24} {cpu:<36} {rate}")


if __name__ == "__main__":
    main()
