"""The docs and the code agree on the environment: every SYSHAX_* variable the docs or the
README name is read by shared/env.py, and every variable env.py reads is in the docs' table."""

from __future__ import annotations

import re
from pathlib import Path

from syshax.shared import env

ROOT = Path(__file__).resolve().parents[2]


def _doc_texts() -> dict[Path, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {f: f.read_text() for f in files}


def test_every_documented_syshax_variable_is_read_by_env() -> None:
    named = {
        (path.name, var)
        for path, text in _doc_texts().items()
        for var in re.findall(r"\bSYSHAX_[A-Z_]+\b", text)
    }
    assert named, "the docs name no SYSHAX_* variable at all: the scan is broken"
    unread = sorted((where, var) for where, var in named if var not in env.ENV_VARS)
    assert not unread, f"documented but never read: {unread}"


def test_every_variable_env_reads_is_in_the_configuration_table() -> None:
    table = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", table, flags=re.MULTILINE))
    missing = sorted(set(env.ENV_VARS) - rows)
    assert not missing, f"read by shared/env.py but not in docs/configuration.md: {missing}"
