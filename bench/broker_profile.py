"""Where Redis's CPU goes per streamed token: one farm of bench/broker.py (this checkout, or
another with --root), one round per level, with Redis's own counters around each round.

Per round: `CONFIG RESETSTAT`, then `INFO commandstats` (calls and usec per command),
`INFO stats` (commands, net bytes in and out) and `INFO cpu` (Redis's user+sys seconds) after
it, each divided by the tokens streamed. Also an idle stretch of as long (what the farm costs
Redis doing nothing). With --perf, `perf record -g` on the redis-server during a second round
(the flat profile, by symbol, is printed); with --strace, `strace -c -f` during a third (it
slows Redis down: its round is not used for the CPU figures).

    .venv/bin/python bench/broker_profile.py --streams 64,256 --perf --strace
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker import HERE, SITECUSTOMIZE, Farm, one_round  # noqa: E402


def counters(r: redis.Redis) -> dict[str, float]:
    out: dict[str, float] = {}
    stats = r.info("stats")
    for k in ("total_commands_processed", "total_net_input_bytes", "total_net_output_bytes"):
        out[k] = float(stats[k])
    cpu = r.info("cpu")
    out["cpu_s"] = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    out["cpu_user_s"] = float(cpu["used_cpu_user"])
    out["cpu_sys_s"] = float(cpu["used_cpu_sys"])
    for name, st in r.info("commandstats").items():
        cmd = name.removeprefix("cmdstat_")
        out[f"calls:{cmd}"] = float(st["calls"])
        out[f"usec:{cmd}"] = float(st["usec"])
    return out


def measured(r: redis.Redis, farm: Farm, streams: int, tokens: int, spread: float) -> dict:
    r.config_resetstat()
    before = counters(r)
    t0 = time.perf_counter()
    res = asyncio.run(one_round(farm, streams, tokens, spread))
    wall = time.perf_counter() - t0
    after = counters(r)
    diff = {k: after[k] - before.get(k, 0.0) for k in after}
    return {"round": res, "diff": diff, "wall": wall, "tokens": streams * tokens}


def idle(r: redis.Redis, seconds: float) -> dict:
    r.config_resetstat()
    before = counters(r)
    time.sleep(seconds)
    after = counters(r)
    return {k: after[k] - before.get(k, 0.0) for k in after}


def show(title: str, d: dict, per: float, unit: str) -> None:
    """Counters `d` divided by `per` (tokens, or seconds)."""
    print(f"\n== {title}")
    cpu = d["cpu_s"] / per * 1e6
    cmd_usec = sum(v for k, v in d.items() if k.startswith("usec:"))
    print(f"redis CPU {cpu:.2f} us/{unit} (user {d['cpu_user_s'] / per * 1e6:.2f}, "
          f"sys {d['cpu_sys_s'] / per * 1e6:.2f}); inside commands {cmd_usec / per:.2f} us/{unit} "
          f"({cmd_usec / 1e6 / max(d['cpu_s'], 1e-9):.0%})")  # fmt: skip
    print(f"commands {d['total_commands_processed'] / per:.3f}/{unit}, in "
          f"{d['total_net_input_bytes'] / per:.1f} B/{unit}, out "
          f"{d['total_net_output_bytes'] / per:.1f} B/{unit}")  # fmt: skip
    rows = sorted(
        ((k[6:], d[k], d.get("usec:" + k[6:], 0.0)) for k in d if k.startswith("calls:")),
        key=lambda x: -x[2],
    )
    for cmd, calls, usec in rows:
        if calls:
            print(f"  {cmd:22} {calls / per:9.4f} calls/{unit} {usec / per:8.3f} us/{unit} "
                  f"{usec / calls:7.2f} us/call")  # fmt: skip


# Redis 7's functions that a token's cost goes through (children: with what they call).
PERF_SYMBOLS = (
    "aeProcessEvents", "epoll_wait", "readQueryFromClient", "processInputBuffer",
    "processMultibulkBuffer", "processCommand", "call", "xaddCommand", "publishCommand",
    "pubsubPublishMessage", "xreadgroupCommand", "addReplyProto", "beforeSleep",
    "handleClientsWithPendingWritesUsingThreads", "writeToClient", "serverCron", "clientsCron",
    "databasesCron", "activeExpireCycle", "__libc_read", "__libc_write", "__GI___libc_read",
    "__GI___libc_write", "finish_task_switch.isra.0", "schedule", "entry_SYSCALL_64",
)  # fmt: skip


def perf_round(pid: int, out: Path, go) -> str:
    rec = subprocess.Popen(
        [
            "perf",
            "record",
            "--call-graph",
            os.environ.get("PERF_CG", "dwarf,8192"),
            "-F",
            os.environ.get("PERF_F", "4000"),
            "-p",
            str(pid),
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    go()
    rec.send_signal(signal.SIGINT)
    rec.wait(60)

    def report(*extra: str) -> str:
        cmd = ["perf", "report", "-i", str(out), "--sort", "symbol", "--stdio", "-g", "none"]
        return subprocess.run([*cmd, *extra], capture_output=True, text=True).stdout

    flat = report("--no-children", "--percent-limit", "1")
    lines = ["self time by symbol (>= 1%):"]
    lines += [ln for ln in flat.splitlines() if ln.strip() and not ln.startswith("#")]
    lines.append("with children (inclusive), Redis's main paths:")
    kids = {}
    for ln in report("--children").splitlines():
        m = re.match(r"\s*([\d.]+)%\s+([\d.]+)%\s+\[[.k]\]\s+(\S+)", ln)
        if m:
            kids[m.group(3)] = (float(m.group(1)), float(m.group(2)))
    for sym in PERF_SYMBOLS:
        if sym in kids:
            lines.append(f"  {kids[sym][0]:6.2f}%  (self {kids[sym][1]:5.2f}%)  {sym}")
    return "\n".join(lines)


def strace_round(pid: int, go) -> str:
    tr = subprocess.Popen(
        ["strace", "-c", "-f", "-p", str(pid)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )  # fmt: skip
    time.sleep(0.5)
    go()
    tr.send_signal(signal.SIGINT)
    return tr.communicate(timeout=60)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--root", default=None, help="another checkout to profile (a git worktree)")
    p.add_argument("--hide", default="", help="packages --root runs without (as bench/broker.py --before-without; uvloop,httptools for the tree before issue 31)")  # fmt: skip
    p.add_argument("--streams", default="64,256")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--spread", type=float, default=1.0)
    p.add_argument("--step-delay", type=float, default=0.0, help="echo engine seconds per step")
    p.add_argument("--perf", action="store_true", help="perf record Redis during a second round")
    p.add_argument("--strace", action="store_true", help="strace -c Redis during a third round")
    args = p.parse_args()
    levels = [int(x) for x in args.streams.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="syshax-bench-broker-profile-"))
    root = Path(args.root).resolve() if args.root else HERE
    shim = logdir / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE.format(here=str(HERE)))
    farm = Farm("profile", root, max(levels), logdir, args.step_delay)
    farm.start(shim, args.hide, uncap=bool(args.hide))
    r = redis.Redis.from_url(farm.redis.url)
    pid = farm.pids()["redis"]
    try:
        asyncio.run(one_round(farm, 4, 8))
        time.sleep(1)
        for lv in levels:
            m = measured(r, farm, lv, args.tokens, args.spread)
            print(f"\n#### {lv} streams: {m['round']['tok_s']:.0f} tok/s, wall {m['wall']:.1f} s, "
                  f"tokens {m['tokens']}")  # fmt: skip
            show(f"{lv} streams, per token", m["diff"], m["tokens"], "token")
            time.sleep(1.0)  # the round's tail (connections closing) is not idle
            show(f"idle, per second (for {m['wall']:.1f} s)", idle(r, m["wall"]), 1.0, "s")
            go = lambda lv=lv: asyncio.run(one_round(farm, lv, args.tokens, args.spread))  # noqa: E731
            if args.perf:
                print(f"\n== perf, {lv} streams (flat, self time by symbol)")
                print(perf_round(pid, logdir / f"perf-{lv}.data", go))
            if args.strace:
                print(f"\n== strace -c, {lv} streams (a slowed round)")
                print(strace_round(pid, go))
    finally:
        farm.stop()
    print(f"\nlogs and perf data: {logdir} (pid {os.getpid()})")


if __name__ == "__main__":
    main()
