"""A local Redis Cluster for tests: 3 primaries with one replica each, from the machine's
`redis-server` on free ports (`--cluster-enabled yes`, joined by `redis-cli --cluster create
... --cluster-replicas 1`), each node in a directory of its own, all stopped at the end."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.cluster import RedisCluster

NODES = 6  # 3 primaries + 3 replicas


def cluster_tools() -> str | None:
    """Why no cluster can be started here (None: it can)."""
    for exe in ("redis-server", "redis-cli"):
        if shutil.which(exe) is None:
            return f"no {exe} on PATH"
    return None


class LocalCluster:
    def __init__(self, node_timeout_ms: int = 1000) -> None:
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen] = {}
        self._dir = tempfile.TemporaryDirectory(prefix="syshax-cluster-")

    @property
    def url(self) -> str:
        """One node's URL, as a farm names the cluster (any node will do)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def _launch_node(self, timeout: float, tries: int = 5) -> int:
        """Start one node on a free port pair and wait until it answers. A port found free can
        still be taken before redis-server binds it (another test's connection, another
        process): the server then exits at once, and the node is started again elsewhere."""
        for _ in range(tries):
            port = _cluster_port(exclude=self.ports)
            self._start_node(port)
            if _wait_ping(port, timeout, self.procs[port]):
                return port
            del self.procs[port]
        raise RuntimeError(f"no cluster node would start in {tries} tries")

    def _start_node(self, port: int) -> None:
        home = Path(self._dir.name) / str(port)
        home.mkdir(exist_ok=True)
        args = [
            "redis-server",
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--dir", str(home),
            "--save", "",
            "--appendonly", "no",
            "--loglevel", "warning",
            "--logfile", "redis.log",
            "--hz", "100",
        ]  # fmt: skip
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        self.ports = []
        while len(self.ports) < NODES:
            port = self._launch_node(timeout)
            self.ports.append(port)
        create = ["redis-cli", "--cluster", "create"]
        create += [f"127.0.0.1:{p}" for p in self.ports]
        create += ["--cluster-replicas", "1", "--cluster-yes"]
        out = subprocess.run(create, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        self.wait_ok(timeout)
        self.wait_replicas_synced(timeout)
        return self

    def wait_replicas_synced(self, timeout: float = 30.0) -> None:
        """Until every replica's link to its primary is up: a replica that never finished its
        first sync refuses to fail over (its data is "too old"), so a test that kills a primary
        right after the cluster was created would wait for a failover that never comes."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            links = [_replica_link(p) for p in self.live_ports()]
            if links.count("up") == NODES // 2 and "down" not in links:
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster's replicas did not finish their first sync")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and every slot has a primary."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self._node_ok(p) for p in self.live_ports()):
                return
            time.sleep(0.1)
        states = {p: self._node_state(p) for p in self.live_ports()}
        raise RuntimeError(f"the cluster did not become ok in {timeout:.0f}s: {states}")

    def _node_state(self, port: int) -> str:
        """What one node says of the cluster, for a failure's message."""
        with contextlib.closing(redis.Redis(port=port, socket_timeout=1)) as r:
            try:
                info = r.cluster("info")
            except redis.RedisError as exc:
                return f"{type(exc).__name__}: {exc}"
        keep = ("cluster_state", "cluster_slots_ok", "cluster_slots_fail", "cluster_known_nodes")
        return ", ".join(f"{k}={info.get(k)}" for k in keep)

    def _node_ok(self, port: int) -> bool:
        with contextlib.closing(redis.Redis(port=port, socket_timeout=1)) as r:
            try:
                info = r.cluster("info")
            except redis.RedisError:
                return False
        state = info.get("cluster_state") if isinstance(info, dict) else None
        return state == "ok" and int(info.get("cluster_slots_ok", 0)) == 16384

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def client(self) -> RedisCluster:
        """A cluster client through a node that is alive (the URL's may have been killed)."""
        return RedisCluster(host="127.0.0.1", port=self.live_ports()[0])

    def primary_of(self, key: str) -> int:
        """The port of the primary that holds `key`'s slot now."""
        with contextlib.closing(self.client()) as rc:
            return rc.get_node_from_key(key).port

    def primaries(self) -> list[int]:
        with contextlib.closing(self.client()) as rc:
            return sorted(n.port for n in rc.get_primaries())

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: its replica takes over after node_timeout)."""
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._dir.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_ping(port: int, timeout: float, proc: subprocess.Popen) -> bool:
    """True once the node answers; False at once if its server exited (it could not bind)."""
    end = time.monotonic() + timeout
    client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
    with contextlib.closing(client) as r:
        while time.monotonic() < end:
            try:
                r.ping()
                return True
            except redis.RedisError:  # refused, or something else listens there and is silent
                if proc.poll() is not None:
                    return False
                time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer in {timeout:.0f}s")


# Client ports and ports bound to 0 come from the kernel's ephemeral range (32768-60999 on
# Linux by default); node ports and their bus ports (+10000) stay below it so that no
# connection made meanwhile can take them.
_PORT_LOW, _PORT_HIGH = 20000, 22700


def _cluster_port(exclude: list[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too, not one of `exclude`."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(_PORT_LOW, _PORT_HIGH)
        if port not in exclude and all(_free(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _free(port: int) -> bool:
    with contextlib.closing(socket.socket()) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _replica_link(port: int) -> str | None:
    """A replica's master_link_status ("up" / "down"); None for a primary or a silent node."""
    with contextlib.closing(redis.Redis(port=port, socket_timeout=1)) as r:
        try:
            info = r.info("replication")
        except redis.RedisError:
            return "down"
    return info.get("master_link_status") if info.get("role") == "slave" else None
