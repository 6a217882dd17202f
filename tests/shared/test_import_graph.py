"""No import circle among the modules of shared/ (the config's schema, checks and file code
once imported each other, broken only by imports inside functions; the check counts those)."""

from __future__ import annotations

from ..workers.test_import_graph import ROOT, cycles, import_graph


def test_shared_has_no_import_circle():
    graph = import_graph(ROOT / "shared", "syshax.shared")
    assert "syshax.shared.config_schema" in graph["syshax.shared.config"], "the walk sees imports"
    found = cycles(graph)
    assert not found, "\n".join(" -> ".join(c) for c in found)
