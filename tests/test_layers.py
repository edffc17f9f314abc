"""The layers point one way: no import cycle among our modules (imports inside functions count), and the core imports
neither the adapters nor the kit. Read from the source (``tests/import_graph.py``); a failure names each offending edge."""

from __future__ import annotations

import attrs

from tests import import_graph
from tests.import_graph import Edge, cycles, edges


def test_the_graph_sees_imports_inside_functions():
    """``core/cli/cli.py`` imports ``core/cli/demo.py`` only inside a function: the graph must hold that edge."""
    graph = edges()
    assert len(graph) > 200, f"only {len(graph)} edges: has the layout changed?"
    assert any(e.source == "weightcache.core.cli.cli" and e.target == "weightcache.core.cli.demo" for e in graph)


def test_no_import_cycle_even_inside_functions():
    found = cycles(edges())
    assert not found, "import cycles (move the shared piece down into a module both can import):\n" + "\n".join(
        "  cycle:\n" + "\n".join(f"    {edge}" for edge in cycle) for cycle in found
    )


def test_the_core_imports_neither_the_adapters_nor_the_kit():
    upward = [e for e in edges() if e.source.startswith("weightcache.core") and not e.target.startswith("weightcache.core")]
    assert not upward, "the core finds adapters and the kit through entry points; these imports point up:\n" + "\n".join(
        f"  {edge}" for edge in upward
    )


def test_a_cycle_is_reported_with_its_edges():
    """The check itself: a made-up two-module cycle comes back as its two edges, an edge into it from outside does not."""
    a_b, b_a, c_a = Edge("a", "b", "a.py:1"), Edge("b", "a", "b.py:3"), Edge("c", "a", "c.py:2")
    assert cycles([a_b, b_a, c_a]) == [[a_b, b_a]]
    assert str(b_a) == "b -> a (b.py:3)"
    assert attrs.has(Edge) and import_graph.ROOT.joinpath("core").is_dir()
