"""The embedded Redis of `syshax run` (broker/farm_redis.py), started here as `syshax run`
starts it: only its owner reaches it, only with the password, and its ACL user cannot touch
the server's files, users or whole dataset."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis
from syshax.broker.embedded import free_port
from syshax.broker.farm_redis import DENIED_COMMANDS, FarmRedis

from ..other_user import run_as_nobody

# Valid arguments for each denied command: Redis checks a command's arity before its ACL.
ARGS = {
    "config": ("SET", "dir", "/tmp"),
    "debug": ("SLEEP", "0"),
    "module": ("LIST",),
    "save": (),
    "bgsave": (),
    "bgrewriteaof": (),
    "shutdown": (),
    "flushall": (),
    "flushdb": (),
    "keys": ("*",),
    "acl": ("WHOAMI",),
    "monitor": (),
    "sync": (),
    "psync": ("?", "-1"),
    "replicaof": ("NO", "ONE"),
    "slaveof": ("NO", "ONE"),
    "failover": (),
    "migrate": ("127.0.0.1", "1", "k", "0", "100"),
}


@pytest.fixture
def server(tmp_path):
    started = []

    def start(home: Path, **kw) -> FarmRedis:
        fr = FarmRedis(home, **kw)
        fr.write_conf()
        proc = subprocess.Popen(fr.argv())
        started.append(proc)
        fr.wait_ready(20, alive=lambda: proc.poll() is None)
        return fr

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(10)


def test_only_the_password_and_no_admin_command(server, tmp_path):
    fr = server(tmp_path / "farm", tcp_port=free_port(), maxmemory_mib=64)
    assert fr.password not in " ".join(fr.argv())  # on disk (0600), not on the command line
    assert fr.conf_path.stat().st_mode & 0o777 == 0o600
    assert fr.home.stat().st_mode & 0o777 == 0o700
    r = fr.client()
    assert r.ping() and r.xadd("s", {"a": 1}) and r.publish("c", "x") == 0
    info = r.info("memory")
    assert info["maxmemory"] == 64 * 2**20 and info["maxmemory_policy"] == "noeviction"
    assert r.info("persistence")["aof_enabled"] == 1
    assert set(ARGS) == set(DENIED_COMMANDS)
    for command, args in ARGS.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.execute_command(command.upper(), *args)
    # The TCP port asks for the password as the socket does; `default` is off.
    tcp = redis.Redis(port=fr.tcp_port, socket_connect_timeout=2)
    with pytest.raises(redis.exceptions.ConnectionError, match="authenticated"):
        tcp.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=fr.tcp_port, username="default", password="").ping()
    assert redis.Redis.from_url(fr.tcp_url).ping()


def test_another_user_reaches_neither_the_socket_nor_the_password(server, tmp_path):
    fr = server(tmp_path / "farm")

    def probe(socket_path: str, conf: str) -> list[str]:
        out = []
        for action in (lambda: redis.Redis(unix_socket_path=socket_path).ping(),
                       lambda: Path(conf).read_text()):  # fmt: skip
            try:
                action()
                out.append("ok")
            except (OSError, redis.ConnectionError) as exc:
                out.append("refused" if "ermission" in str(exc) else repr(exc))
        return out

    assert run_as_nobody(probe, str(fr.socket), str(fr.conf_path)) == ["refused", "refused"]


def test_a_long_home_puts_the_socket_in_a_short_private_directory(server, tmp_path):
    home = tmp_path / ("d" * 60) / ("e" * 60) / "farm"
    fr = server(home)
    assert len(str(fr.socket)) <= 100 and fr.socket.parent != fr.home
    assert fr.socket.parent.stat().st_mode & 0o777 == 0o700
    assert fr.client().ping()


def test_the_data_survives_a_restart(server, tmp_path):
    fr = server(tmp_path / "farm")
    fr.client().rpush("rq:queue:x", "job")
    time.sleep(1.5)  # appendfsync everysec
    # A new server on the same directory (a new password, as at every start) has the data.
    again = FarmRedis(fr.home)
    again.write_conf()
    proc = subprocess.Popen(again.argv())
    try:
        again.wait_ready(20, alive=lambda: proc.poll() is None)
    except Exception:
        proc.kill()
        raise
    try:
        assert again.client().lrange("rq:queue:x", 0, -1) == [b"job"]
    finally:
        proc.terminate()
        proc.wait(10)
