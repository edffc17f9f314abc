"""The layers point one way: no import cycle among our modules (imports inside functions count), the core imports
neither the adapters nor the kit, and each of the core's folders imports only the layers below it. Read from the source
(``tests/import_graph.py``); a failure names each offending edge with its file and line."""

from __future__ import annotations

import attrs

from tests import import_graph
from tests.import_graph import Edge, cycles, edges, modules, place, upward

# The core's layers, bottom first, each a folder of core/ (docs/architecture.md draws them). A module may
# import the foundation, its own folder and the folders listed before its own, never one listed after it.
LAYERS = (
    "arena",
    "quantization",
    "layout",
    "wire",
    "identity",
    "client",
    "server",
    "load",
    "node",
    "flow",
    "refit",
    "cli",
    "spare",
)
# The foundation: top-level modules of core/ that every layer may use; they import only one another (and the
# package's own __init__). A new module goes into the folder of its layer; it joins these only if every layer needs it.
FOUNDATION = frozenset(
    {
        "cpus",
        "cuda_driver",
        "device",
        "dtypes",
        "entry_points",
        "envvars",
        "errors",
        "fileio",
        "fingerprint",
        "gc_pause",
        "hookspecs",
        "memfd",
        "old_paths",
        "options",
        "progress",
        "request",
        "socket_dir",
    }
)


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


def test_every_core_module_is_in_one_layer():
    core = {name: path for name, path in modules().items() if name.startswith("weightcache.core")}
    unplaced = [
        f"  {name} ({path.relative_to(import_graph.ROOT)})"
        for name, path in core.items()
        if place(name, FOUNDATION, LAYERS) is None
    ]
    assert not unplaced, (
        "modules in no layer: move each into the folder of its layer (LAYERS in tests/test_layers.py, drawn in "
        "docs/architecture.md), or add it to FOUNDATION if every layer needs it and it imports only the foundation:\n"
        + "\n".join(unplaced)
    )
    folders = {p.name for p in import_graph.ROOT.joinpath("core").iterdir() if p.joinpath("__init__.py").exists()}
    assert folders == set(LAYERS), f"core/'s folders {sorted(folders)} are not the layers {sorted(LAYERS)}"


def test_each_layer_imports_only_the_layers_below_it():
    found = upward(edges(), FOUNDATION, LAYERS)
    assert not found, (
        "imports that point up (a layer imports the foundation, its own folder and the layers before it in LAYERS; move "
        "the shared piece down into the lower layer):\n"
        + "\n".join(f"  {edge}: {_layer(edge.source)} imports {_layer(edge.target)}" for edge in found)
    )


def test_an_import_that_points_up_is_reported_with_its_edge():
    """The check itself: on made-up layers, an edge from a lower layer (or the foundation) into a higher one comes back,
    edges down, within a layer and within the foundation do not."""
    layers, foundation = ("low", "high"), frozenset({"base", "other"})
    up = Edge("weightcache.core.low.a", "weightcache.core.high.b", "core/low/a.py:7")
    base_up = Edge("weightcache.core.base", "weightcache.core.low.a", "core/base.py:3")
    down = Edge("weightcache.core.high.b", "weightcache.core.low.a", "core/high/b.py:2")
    inside = Edge("weightcache.core.high.b", "weightcache.core.high.c", "core/high/b.py:4")
    flat = Edge("weightcache.core.base", "weightcache.core.other", "core/base.py:5")
    to_foundation = Edge("weightcache.core.low.a", "weightcache.core.base", "core/low/a.py:1")
    graph = [up, base_up, down, inside, flat, to_foundation]
    assert upward(graph, foundation, layers) == [up, base_up]
    assert str(up) == "weightcache.core.low.a -> weightcache.core.high.b (core/low/a.py:7)"
    assert place("weightcache.core.stray", foundation, layers) is None
    assert place("weightcache.core", foundation, layers) == "foundation"


def test_the_architecture_drawing_holds_every_module_in_its_folder():
    """docs/architecture.md draws the layers as folders, top first, with every module of core/ in its own."""
    text = import_graph.ROOT.joinpath("docs", "architecture.md").read_text()
    drawing = text.split("<!-- layers:begin -->", 1)[1].split("<!-- layers:end -->", 1)[0]
    drawn, folder = set(), None
    order = []
    for line in drawing.splitlines():
        head = line.strip().split(" ", 1)[0]
        if head.startswith("core/") and head.endswith("/"):
            folder = head.removeprefix("core/").rstrip("/")
            order.append(folder or "foundation")
        elif head.endswith(".py") and folder is not None:
            drawn.add(f"core/{folder}/{head}" if folder else f"core/{head}")
    on_disk = {str(path.relative_to(import_graph.ROOT)) for path in import_graph.ROOT.joinpath("core").rglob("*.py")}
    on_disk = {p for p in on_disk if not p.endswith("__init__.py")}
    assert drawn == on_disk, f"drawn but missing: {sorted(drawn - on_disk)}; not drawn: {sorted(on_disk - drawn)}"
    assert order == [*reversed(LAYERS), "foundation"], order


def _layer(module: str) -> str:
    found = place(module, FOUNDATION, LAYERS)
    return "the foundation" if found == "foundation" else f"{found}/"


def test_a_static_walk_of_weightcache_load_never_climbs_back_through_the_layers():
    """Issue 52 counted 42 steps where ``weightcache load`` -> publish went back up a layer; now every module the
    command reaches (imports inside functions count) calls only down, through the one plan (``flow/plan.py``) to the
    arenas and the node's and the fleet's sources (the reader is the adapter's, found through its entry point)."""
    graph = edges()
    reached, todo = set(), ["weightcache.core.cli.load"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(edge.target for edge in graph if edge.source == module)
    for needed in ("flow.plan", "flow.loader", "load.export", "load.publish", "node.fill", "node.fleet.pull", "node.fleet.files"):
        assert f"weightcache.core.{needed}" in reached, f"the walk from weightcache load no longer reaches {needed}"
    climbs = upward([edge for edge in graph if edge.source in reached], FOUNDATION, LAYERS)
    assert not climbs, f"{len(climbs)} steps back up a layer:\n" + "\n".join(f"  {edge}" for edge in climbs)
