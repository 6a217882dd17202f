"""Run a function as another local user (uid/gid 65534, "nobody"), to check what the farm
exposes to the other users of its host. The tests run as root here (CI too); elsewhere the
callers skip: only root can become another user."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest

NOBODY = 65534


def run_as_nobody(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a forked child that dropped to uid/gid 65534; its return value (picklable)
    or the exception it raised, re-raised here."""
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root (the tests run as root in CI)")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result: Any = ("ok", fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the parent
            result = ("error", repr(exc))
        with os.fdopen(write, "wb") as fh:
            pickle.dump(result, fh)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    if kind == "error":
        raise AssertionError(f"as uid {NOBODY}: {value}")
    return value
