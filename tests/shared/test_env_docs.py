"""The docs and the code agree on the environment: every SYSHAX_* variable the docs or the
README name is read by shared/env.py, and every variable env.py reads is in the docs' table."""

from __future__ import annotations

import ast
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


PACKAGE_DIRS = ("syshax", "shared", "workers", "gateway", "broker", "batch")


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read a variable: os.environ.get(...), os.getenv(...), os.environ[...] (a copy
    for a child process, a setdefault or an update writes and is allowed)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            is_environ_get = f.attr == "get" and ast.unparse(f.value) in ("os.environ", "environ")
            if is_environ_get or ast.unparse(f) in ("os.getenv", "getenv"):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) in ("os.environ", "environ")
        ):
            lines.append(node.lineno)
    return lines


def test_only_env_py_reads_the_environment() -> None:
    files = [f for d in PACKAGE_DIRS for f in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50, "the scan found too few files: it is broken"
    readers = [
        f"{f.relative_to(ROOT)}:{line}"
        for f in files
        if f != ROOT / "shared" / "env.py"
        for line in _environment_reads(ast.parse(f.read_text()))
    ]
    assert not readers, f"environment read outside shared/env.py: {readers}"


def test_the_environment_scan_sees_each_form_of_read() -> None:
    code = "import os\na = os.environ.get('X')\nb = os.getenv('Y')\nc = os.environ['Z']\n"
    code += "d = dict(os.environ)\nos.environ.setdefault('W', '1')\n"
    assert _environment_reads(ast.parse(code)) == [2, 3, 4]
