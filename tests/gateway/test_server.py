"""gateway/server.py: the start-up warning for a gateway open beyond loopback with no API key
(checked without starting uvicorn)."""

from __future__ import annotations

import logging

import pytest
from syshax.gateway.server import warn_if_open
from syshax.gateway.settings import GatewaySettings
from syshax.shared.net import is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),  # all of 127.0.0.0/8
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LocalHost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("gateway.internal", False),  # a name may resolve to any interface
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_open_bind_without_keys_warns_once_with_the_way_out(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="syshax.gateway.server"):
        assert warn_if_open(GatewaySettings(host="0.0.0.0", port=8123))
    (message,) = _warnings(caplog)
    assert "0.0.0.0:8123" in message and "anyone who can reach" in message
    assert "syshax config api_keys" in message and "--api-key" in message


@pytest.mark.parametrize(
    "settings",
    [
        GatewaySettings(host="127.0.0.1"),
        GatewaySettings(host="localhost"),
        GatewaySettings(host="0.0.0.0", api_keys=["k"]),  # open, but keys are required
    ],
)
def test_no_warning_on_loopback_or_with_keys(caplog, settings: GatewaySettings) -> None:
    with caplog.at_level(logging.WARNING, logger="syshax.gateway.server"):
        assert not warn_if_open(settings)
    assert not _warnings(caplog)
