"""Placement of CPU worker threads: parsing and checking CUSTOM_CPU_AFFINITY.

The list is ordered: thread i of the worker is pinned to the i-th CPU listed, so one CPU per
thread and as many CPUs as threads. Decode splits each matmul's rows equally over the threads,
so the CPUs must also be spread equally over the NUMA nodes they use: every node's threads then
get the same share of rows and of that node's memory bandwidth, and no node becomes the one the
others wait for. Values come in as arguments; the environment is read in shared/env.py only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

ENV = "CUSTOM_CPU_AFFINITY"
SYSFS_NODES = Path("/sys/devices/system/node")

_NUMBER = re.compile(r"-?[0-9]+")
_NODE_DIR = re.compile(r"node([0-9]+)")
# 'start' or 'start-end'; a leading '-' stays with the start, which is then a negative number.
_SPAN = re.compile(r"(-?[^-]*)(?:-(.*))?", re.DOTALL)


class AffinityError(ValueError):
    """A CPU list that cannot be parsed, or a placement that does not fit the machine."""


def _number(text: str, fail: Callable[[str], AffinityError]) -> int:
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        raise fail(f"{text!r} is not a CPU number")
    value = int(text)
    if value < 0:
        raise fail(f"negative number {value}")
    return value


def _parse(spec: str, source: str, allow_step: bool) -> list[int]:
    cpus: list[int] = []
    seen: set[int] = set()
    for raw in spec.split(","):
        item = raw.strip()

        def fail(problem: str, item: str = item) -> AffinityError:
            return AffinityError(f"{source}={spec!r}: {problem} in item {item!r}")

        if not item:
            raise fail("empty item (stray or doubled comma?)")
        span, colon, step_text = item.partition(":")
        if colon and not allow_step:
            raise fail("a step is not allowed here")
        step = _number(step_text, fail) if colon else 1
        if step < 1:
            raise fail(f"step {step} must be at least 1")
        match = _SPAN.fullmatch(span)
        assert match is not None  # the pattern matches every string
        start_text, end_text = match.group(1), match.group(2)
        start = _number(start_text, fail)
        if end_text is None:
            if colon:
                raise fail("a step needs a range 'start-end:step'")
            end = start
        else:
            end = _number(end_text, fail)
        if end < start:
            raise fail(f"end {end} is below start {start}")
        for cpu in range(start, end + 1, step):
            if cpu in seen:
                raise fail(f"CPU {cpu} is listed twice")
            seen.add(cpu)
            cpus.append(cpu)
    return cpus


def parse_cpu_list(spec: str) -> list[int]:
    """Parse '0-15', '0-30:2,32-62:2', '3', '0,2,4-7' into CPU ids, in the order written."""
    return _parse(spec, ENV, allow_step=True)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Compact sorted rendering, e.g. {0, 1, 2, 3, 8, 10, 11} -> '0-3,8,10-11'."""
    parts: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [cpu]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def _count(n: int) -> str:
    return f"{n} CPU" if n == 1 else f"{n} CPUs"


def _usable_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def numa_nodes(sysfs: Path = SYSFS_NODES) -> dict[int, set[int]]:
    """NUMA node id -> its CPU ids, from sysfs `nodeN/cpulist`; one node 0 where there is none.

    Nodes without CPUs (memory-only) are left out. Without the sysfs folder (non-Linux, some
    containers) the machine is taken as one node holding the CPUs this process may use.
    """
    nodes: dict[int, set[int]] = {}
    if sysfs.is_dir():
        for entry in sysfs.iterdir():
            match = _NODE_DIR.fullmatch(entry.name)
            cpulist = entry / "cpulist"
            if not match or not cpulist.is_file():
                continue
            text = cpulist.read_text().strip()
            if text:
                nodes[int(match.group(1))] = set(_parse(text, str(cpulist), allow_step=False))
    if not nodes:
        return {0: _usable_cpus()}
    return dict(sorted(nodes.items()))


def node_of(cpu: int, nodes: dict[int, set[int]]) -> int:
    """The NUMA node holding `cpu`; AffinityError when no node has it."""
    for node, cpus in nodes.items():
        if cpu in cpus:
            return node
    raise AffinityError(f"{ENV}: CPU {cpu} does not exist on this machine")


def validate_affinity(
    cpus: list[int],
    threads: int,
    *,
    nodes: dict[int, set[int]] | None = None,
    allowed: set[int] | None = None,
) -> None:
    """Check one CPU per thread, each usable here, spread equally over the NUMA nodes used.

    `nodes` defaults to numa_nodes(), `allowed` to os.sched_getaffinity(0).
    """
    if len(cpus) != threads:
        raise AffinityError(
            f"{ENV} lists {_count(len(cpus))} ({format_cpu_list(cpus)}) but the worker runs "
            f"{threads} threads: OMP_NUM_THREADS (or the worker's threads setting) must equal "
            f"the number of CPUs listed, one thread pinned per CPU"
        )
    nodes = numa_nodes() if nodes is None else nodes
    allowed = _usable_cpus() if allowed is None else allowed
    per_node: dict[int, list[int]] = {}
    for cpu in cpus:
        node = node_of(cpu, nodes)
        if cpu not in allowed:
            raise AffinityError(
                f"{ENV}: CPU {cpu} is not usable by this process "
                f"(usable CPUs: {format_cpu_list(allowed) or 'none'})"
            )
        per_node.setdefault(node, []).append(cpu)
    if len({len(group) for group in per_node.values()}) > 1:
        counts = "; ".join(
            f"node {node}: {_count(len(group))} ({format_cpu_list(group)})"
            for node, group in sorted(per_node.items())
        )
        raise AffinityError(
            f"{ENV} spreads the threads unequally over NUMA nodes ({counts}): use the same "
            f"number of CPUs on every node used, so each node's threads get an equal share"
        )


def resolve_affinity(
    spec: str | None,
    threads: int,
    *,
    nodes: dict[int, set[int]] | None = None,
    allowed: set[int] | None = None,
) -> list[int] | None:
    """The CPUs to pin threads to, in thread order; None when `spec` is unset or empty."""
    if spec is None or not spec.strip():
        return None
    cpus = parse_cpu_list(spec)
    validate_affinity(cpus, threads, nodes=nodes, allowed=allowed)
    return cpus
