"""Layers point down: shared <- broker <- api <- gateway / workers <- batch <- syshax (commands).

Each package may import only the packages below it (and itself): the broker never knows the
gateway, the gateway and the workers never import each other, batch/ sends requests through the
API layer (the same code the gateway uses), never through the gateway, and only the commands see
everything. Checked on the source, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package folder -> the syshax.* packages its files may import
ALLOWED = {
    "shared": {"shared"},
    "broker": {"shared", "broker"},
    "api": {"shared", "broker", "api"},
    "gateway": {"shared", "broker", "api", "gateway"},
    "workers": {"shared", "broker", "workers"},
    "batch": {"shared", "broker", "api", "workers", "batch"},
}


def _imports(path: Path) -> set[str]:
    """The top-level syshax packages a file imports (syshax.X -> X; relative imports stay
    inside the package and are not listed)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "syshax":
                names = [f"syshax.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "syshax" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_package_imports_only_the_layers_below_it():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            bad = _imports(path) - allowed
            if bad:
                wrong.append(
                    f"{path.relative_to(ROOT)} imports syshax.{', syshax.'.join(sorted(bad))}"
                )
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_every_form_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import syshax.gateway.app\n"
        "from syshax.workers.engine import engine\n"
        "from syshax import batch\n"
        "from . import sibling\n"
        "def late():\n    from syshax.broker.keys import KEYS\n"
    )
    assert _imports(probe) == {"gateway", "workers", "batch", "broker"}


REDIS_COMMANDS = {
    "pipeline", "xadd", "xack", "xdel", "xreadgroup", "xread", "xclaim", "xautoclaim",
    "xpending", "xpending_range", "xlen", "xrange", "xrevrange", "xgroup_create", "hset",
    "hget", "hgetall", "hmget", "hincrby", "hdel", "lpush", "rpush", "ltrim", "lrange",
    "incr", "incrby", "expire", "smembers", "sadd", "srem", "zadd", "zrange", "scan_iter",
}  # fmt: skip


def _redis_calls(path: Path) -> list[str]:
    calls = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in REDIS_COMMANDS
        ):
            calls.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.func.attr}()")
    return calls


def test_every_redis_command_lives_in_broker():
    """Key names and commands in one package (as rq and arq keep them): the gateway, the
    workers, batches and commands ask the broker's functions."""
    calls = []
    for package in ("shared", "api", "gateway", "workers", "batch", "syshax"):
        for path in sorted((ROOT / package).rglob("*.py")):
            calls += _redis_calls(path)
    assert not calls, "\n".join(calls)
