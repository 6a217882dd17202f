"""No import circle among the modules of workers/ (nor of broker/): the worker's collaborators (handoff.py,
upkeep.py) are given what they need by the Worker and never import worker.py back. Checked on
the source: imports inside functions and under `if TYPE_CHECKING:` count too, since a circle
there is still two modules that cannot be understood (or type-checked) one without the other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports (`from . import x` and `from .x import
    y` both name module x; a name that is not a module of the tree is left out)."""
    paths = {_module(p, root, package): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            found |= {t for t in targets if t in paths and t != name}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per back edge of a depth-first walk (none: the graph is acyclic)."""
    state: dict[str, int] = {}  # 1: on the walk's path, 2: done
    path: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                found.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_workers_has_no_import_circle():
    graph = import_graph(ROOT / "workers", "syshax.workers")
    assert "syshax.workers.handoff" in graph["syshax.workers.worker"], "the walk sees imports"
    found = cycles(graph)
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_broker_has_no_import_circle():
    """broker/ too: worker_io.py and choices.py imported each other (the choice handoff's MULTI
    lived in choices.py, on a WorkQueues; it is WorkQueues.hand_over_choice now)."""
    graph = import_graph(ROOT / "broker", "syshax.broker")
    assert "syshax.broker.schemas" in graph["syshax.broker.worker_io"], "the walk sees imports"
    found = cycles(graph)
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_the_check_sees_a_circle_in_every_form_of_import(tmp_path):
    """The circle workers/ had: worker.py imported the handoff, the handoff imported worker.py
    under TYPE_CHECKING; and one through a function's import and an absolute import."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "worker.py").write_text("from . import handoff\n")
    (pkg / "handoff.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .worker import Worker\n"
    )
    (pkg / "sub" / "a.py").write_text("def late():\n    from ..sub import b\n")
    (pkg / "sub" / "b.py").write_text("import x.sub.a\n")
    found = {frozenset(c) for c in cycles(import_graph(pkg, "x"))}
    assert found == {frozenset({"x.worker", "x.handoff"}), frozenset({"x.sub.a", "x.sub.b"})}
    (pkg / "handoff.py").write_text("from .sub import a\n")  # a plain dependency: no circle
    (pkg / "sub" / "b.py").write_text("")
    assert cycles(import_graph(pkg, "x")) == []
