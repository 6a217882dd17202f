"""`syshax dashboard`'s arguments for rq-dashboard: JSON jobs, and credentials whenever it is
reachable from other hosts."""

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


def test_loopback_needs_no_password_and_jobs_are_read_as_json(capsys):
    argv, env = dashboard.dashboard_argv(_args(), "redis://127.0.0.1:1/0")
    assert "--json" in argv and env == {}
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "dashboard.example", "::"])
def test_beyond_loopback_a_password_is_generated_and_shown_once(host, capsys):
    argv, env = dashboard.dashboard_argv(_args("--host", host), "redis://127.0.0.1:1/0")
    password = env["RQ_DASHBOARD_PASSWORD"]
    assert env["RQ_DASHBOARD_USERNAME"] == "admin" and len(password) >= 16
    err = capsys.readouterr().err
    assert err.count(password) == 1 and "generated password" in err
    assert password not in " ".join(argv)  # rq-dashboard reads it from its environment
    again = dashboard.dashboard_argv(_args("--host", host), "redis://127.0.0.1:1/0")[1]
    assert again["RQ_DASHBOARD_PASSWORD"] != password  # a fresh one at every start


def test_a_chosen_password_is_kept(monkeypatch, capsys):
    monkeypatch.setenv("RQ_DASHBOARD_PASSWORD", "chosen")
    env = dashboard.dashboard_argv(_args("--host", "0.0.0.0"), "redis://127.0.0.1:1/0")[1]
    assert env == {"RQ_DASHBOARD_USERNAME": "admin", "RQ_DASHBOARD_PASSWORD": "chosen"}
    assert "chosen" not in capsys.readouterr().err
