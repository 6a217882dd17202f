"""The image installs what pyproject.toml packages: the Dockerfile COPYs every top-level folder
that `[tool.setuptools] package-dir` maps (a folder left out fails `pip install .` in the image,
and no Docker engine runs on CI machines to notice), and the wheel builds from a clean checkout
with every mapped package and the CPU kernels' C sources in it.

With a Docker engine, `make docker-check` builds the image itself (docs/operations.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib is 3.11+
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomli on 3.10")

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["tool"]["setuptools"]


def mapped_top_level_folders(setuptools_table: dict[str, Any]) -> set[str]:
    """The repository's top-level folders that package-dir maps into packages."""
    return {Path(src).parts[0] for src in setuptools_table["package-dir"].values()}


def copied_sources(dockerfile: str) -> set[str]:
    """Every source path of the Dockerfile's COPY instructions (the last argument is the
    destination; --flags such as --chown are skipped; the JSON form is understood)."""
    text = dockerfile.replace("\\\n", " ")  # continuation lines are one instruction
    sources: set[str] = set()
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if len(words) < 2 or words[0].upper() != "COPY":
            continue
        args = words[1].strip()
        parts = json.loads(args) if args.startswith("[") else args.split()
        parts = [p for p in parts if not p.startswith("--")]
        sources.update(p.rstrip("/").removeprefix("./") for p in parts[:-1])
    return sources


def test_copied_sources_parser() -> None:
    text = 'FROM x\nCOPY a.toml README.md ./\nCOPY --chown=1:1 pkg pkg\nCOPY ["b", "c/", "/d"]\n'
    assert copied_sources(text) == {"a.toml", "README.md", "pkg", "b", "c"}
    # A folder that pyproject maps but the Dockerfile lacks is what the real check reports.
    table = {"package-dir": {"syshax": "syshax", "syshax.batch": "batch"}}
    assert mapped_top_level_folders(table) - copied_sources("COPY syshax syshax\n") == {"batch"}


def test_dockerfile_copies_every_mapped_folder() -> None:
    folders = mapped_top_level_folders(_setuptools())
    assert {"syshax", "shared", "workers", "gateway", "broker", "batch"} <= folders
    for folder in folders:
        assert (ROOT / folder).is_dir(), f"pyproject.toml maps {folder}/, which does not exist"
    copied = copied_sources((ROOT / "Dockerfile").read_text())
    missing = sorted(folders - copied)
    assert not missing, (
        f"pyproject.toml maps these folders but the Dockerfile never COPYs them: {missing}"
    )
    # `pip install .` reads both: the metadata, and the readme that metadata names.
    assert {"pyproject.toml", "README.md"} <= copied


def _checkout_files() -> list[str]:
    """Tracked files plus untracked ones git does not ignore: the checkout as it will be once
    committed (so the test passes before a commit too)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot tell which files a clean checkout has")
    res = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"not a git checkout (git ls-files: {res.stderr.strip()})")
    return [f for f in res.stdout.split("\0") if f]


def _has_build_backend() -> bool:
    try:
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
def test_wheel_builds_from_a_clean_checkout(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in _checkout_files():
        path = ROOT / name
        if path.is_file():  # a tracked file deleted in the working tree is not in the checkout
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(out)]
    # setuptools and wheel in the venv: no download; else pip fetches them (build isolation).
    if _has_build_backend():
        cmd.append("--no-build-isolation")
    res = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel_path,) = out.glob("syshax_farm-*.whl")
    names = set(zipfile.ZipFile(wheel_path).namelist())

    assert "syshax/batch/jobs.py" in names
    native_c = sorted(p.name for p in (ROOT / "workers/cpu/native").glob("*.c"))
    assert native_c and all(f"syshax/workers/cpu/native/{n}" in names for n in native_c)
    # Every mapped package: each of its modules, under the package's installed path.
    table = _setuptools()
    for package, folder in table["package-dir"].items():
        installed = package.replace(".", "/")
        modules = sorted(p.name for p in (src / folder).glob("*.py"))
        data = table.get("package-data", {}).get(package, [])
        # package-data patterns may name subfolders (templates/x/*.html): keep the path under
        # the package, not just the file's name.
        files = modules + sorted(
            p.relative_to(src / folder).as_posix() for pat in data for p in (src / folder).glob(pat)
        )
        assert files, f"{folder}/ has nothing to package"
        lost = [f for f in files if f"{installed}/{f}" not in names]
        assert not lost, f"{package} ({folder}/): not in the wheel: {lost}"
