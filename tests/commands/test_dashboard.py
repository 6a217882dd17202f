"""`syshax dashboard`'s credentials: none needed on loopback, always required (generated when
none is given) when it is reachable from other hosts. The app they guard: test_farm_page.py."""

from __future__ import annotations

import argparse

import pytest

from syshax.commands import dashboard


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    dashboard.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch):
    monkeypatch.delenv("RQ_DASHBOARD_PASSWORD", raising=False)
    monkeypatch.delenv("RQ_DASHBOARD_USERNAME", raising=False)


def test_loopback_needs_no_password(capsys):
    assert dashboard.credentials(_args()) == ("", "")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "dashboard.example", "::"])
def test_beyond_loopback_a_password_is_generated_and_shown_once(host, capsys):
    username, password = dashboard.credentials(_args("--host", host))
    assert username == "admin" and len(password) >= 16
    err = capsys.readouterr().err
    assert err.count(password) == 1 and "generated password" in err
    again = dashboard.credentials(_args("--host", host))[1]
    assert again != password  # a fresh one at every start


def test_a_chosen_password_is_kept(monkeypatch, capsys):
    monkeypatch.setenv("RQ_DASHBOARD_PASSWORD", "chosen")
    assert dashboard.credentials(_args("--host", "0.0.0.0")) == ("admin", "chosen")
    assert "chosen" not in capsys.readouterr().err


def test_a_username_without_a_password_is_refused():
    with pytest.raises(ValueError, match="needs a password"):
        dashboard.credentials(_args("--username", "ops"))
