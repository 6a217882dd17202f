"""The start-up warning about a Redis that answers anyone (broker/security.py)."""

from __future__ import annotations

import subprocess

from syshax.broker import security
from syshax.broker.embedded import free_port
from syshax.broker.farm_redis import FarmRedis


def test_an_open_redis_beyond_loopback_is_warned_about(redis_url, monkeypatch):
    # The test server listens on loopback; pretend its address is reachable from other hosts.
    assert security.open_redis_warning(redis_url) is None  # loopback: only this host
    monkeypatch.setattr(security, "is_loopback", lambda host: False)
    warning = security.open_redis_warning(redis_url)
    assert warning is not None and "answers without authentication" in warning
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    assert f"127.0.0.1:{port}" in warning
    # Credentials in the URL, or a server we cannot reach now: nothing to say.
    assert security.open_redis_warning(redis_url.replace("//", "//u:p@")) is None
    assert security.open_redis_warning(f"redis://127.0.0.1:{free_port()}/0", 0.5) is None


def test_a_redis_that_asks_for_a_password_is_not_warned_about(tmp_path, monkeypatch):
    fr = FarmRedis(tmp_path / "farm", tcp_port=free_port())
    fr.write_conf()
    proc = subprocess.Popen(fr.argv())
    try:
        fr.wait_ready(20, alive=lambda: proc.poll() is None)
        monkeypatch.setattr(security, "is_loopback", lambda host: False)
        assert security.open_redis_warning(f"redis://127.0.0.1:{fr.tcp_port}/0") is None
    finally:
        proc.terminate()
        proc.wait(10)
