"""The public API: ``import weightcache`` stays light, every public name of every public module resolves, the adapters
and examples import only public names, and no public name disappears or changes its signature without the snapshot
saying so; each name 0.2.0 served from ``weightcache`` that moved still imports from there, warning.

The snapshot (tests/public_api.json) holds each public module's names, each with ``inspect.signature`` of it (of its
constructor for a class) and of each public method and property a class defines. After a deliberate change, rewrite it with
``WEIGHTCACHE_WRITE_API_SNAPSHOT=1 pytest tests/test_public_api.py`` and say what changed in CHANGELOG.md.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import weightcache

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = Path(__file__).with_name("public_api.json")
PRIVATE = ("weightcache.core", "weightcache.conformance.", "weightcache.adapters")
"""Private module prefixes (``weightcache.conformance`` itself is public, its submodules are not)."""
MODULES = (*weightcache.FACES, "weightcache.conformance")
"""Every public module."""
NAMES_0_2_0 = Path(__file__).with_name("public_names_0_2_0.txt").read_text().split()
"""What 0.2.0 served from ``weightcache``: each keeps importing from there for a minor version."""


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(no signature)"


def _describe(obj: object) -> object:
    """What the snapshot keeps of one public name: its signature, and for a class its own public members' too."""
    if inspect.isclass(obj):
        members = {}
        for cls in obj.__mro__:
            if not cls.__module__.startswith("weightcache."):
                continue
            for name, member in vars(cls).items():
                if name.startswith(("_", "test_")) or name in members:  # a kit check is no API: subclasses inherit it
                    continue
                if isinstance(member, property):
                    members[name] = "property"
                elif isinstance(member, (classmethod, staticmethod)) or inspect.isfunction(member):
                    members[name] = _signature(getattr(obj, name))
        return {"class": _signature(obj), "members": dict(sorted(members.items()))}
    if callable(obj):
        return _signature(obj)
    return type(obj).__name__


def current_api() -> dict[str, dict[str, object]]:
    api = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        api[module_name] = {name: _describe(getattr(module, name)) for name in sorted(module.__all__)}
    return api


def test_the_public_api_matches_its_snapshot():
    api = current_api()
    if os.environ.get("WEIGHTCACHE_WRITE_API_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
    recorded = {
        f"{module}.{name}": value for module, names in json.loads(SNAPSHOT.read_text()).items() for name, value in names.items()
    }
    now = {f"{module}.{name}": value for module, names in api.items() for name, value in names.items()}
    gone = sorted(set(recorded) - set(now))
    changed = [
        f"  {name}: was {json.dumps(recorded[name])}\n{' ' * (len(name) + 4)}now {json.dumps(now[name])}"
        for name in sorted(set(recorded) & set(now))
        if recorded[name] != now[name]
    ]
    added = sorted(set(now) - set(recorded))
    assert not (gone or changed or added), (
        "the public API changed (a removal or a changed signature breaks adapters and engine forks: keep the old name "
        "working, warning, for a minor version; then rewrite the snapshot with WEIGHTCACHE_WRITE_API_SNAPSHOT=1 and say "
        f"it in CHANGELOG.md):\n  gone: {gone}\n  added: {added}\n" + "\n".join(changed)
    )


def test_the_snapshot_holds_no_address_or_path_of_this_machine():
    text = SNAPSHOT.read_text()
    assert " at 0x" not in text and str(ROOT) not in text


def test_every_public_name_resolves_to_the_object_of_its_module():
    for face, names in weightcache.public_names().items():
        module = importlib.import_module(face)
        for name, home in names.items():
            assert getattr(module, name) is getattr(importlib.import_module(home), name), f"{face}.{name}"
        assert sorted(module.__all__) == sorted(names), face
        with pytest.raises(AttributeError, match="no attribute 'load_modle'"):
            module.load_modle  # noqa: B018
    kit = importlib.import_module("weightcache.conformance")
    assert all(getattr(kit, name) is not None for name in kit.__all__)
    assert {"load_model", "ServerProcess", "WeightCacheError"} <= set(weightcache.__all__)
    assert len(weightcache.__all__) <= 40, (
        "weightcache is for people who load and serve models: put the rest in a module of its audience"
    )


def test_each_name_0_2_0_served_still_imports_from_weightcache_warning_where_it_lives_now():
    assert set(NAMES_0_2_0) == set(weightcache.NAMES) | set(weightcache.MOVED), "a name of 0.2.0 is neither public nor moved"
    assert not set(weightcache.NAMES) & set(weightcache.MOVED)
    assert not set(weightcache.MOVED) & set(weightcache.__all__) and not set(weightcache.MOVED) & set(dir(weightcache))
    for name, face in weightcache.MOVED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(weightcache, name)
        assert value is getattr(importlib.import_module(face), name), name
        assert [str(w.message) for w in caught] == [
            f"weightcache.{name} is deprecated since weightcache 0.3.0 and goes in 0.4.0: use from {face} import {name}"
        ]
        assert caught[0].filename == __file__, "the warning points at the code that asked for the old name"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from weightcache import hookimpl  # the 0.2.0 spelling

    assert hookimpl is importlib.import_module("weightcache.adapter").hookimpl
    assert caught[0].filename == __file__ and "use from weightcache.adapter import hookimpl" in str(caught[0].message)


def test_importing_weightcache_stays_light():
    """``import weightcache`` loads no framework and none of the private layers: each name loads its module on use."""
    code = (
        "import sys, time\nstart = time.perf_counter()\nimport weightcache\ntook = time.perf_counter() - start\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'pytest', 'numpy', 'safetensors')"
        " or m.startswith(('weightcache.conformance', 'weightcache.adapters', 'weightcache.core.flow', 'weightcache.core.load')))\n"
        "print(heavy, round(took * 1000, 1))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    heavy, took_ms = out.rsplit(" ", 1)
    assert heavy == "[]", f"import weightcache imported {heavy}"
    # an order of magnitude only (the module list above is the real check): a framework's import costs seconds
    assert float(took_ms) < 3000, f"import weightcache took {took_ms} ms"


def _private_imports(path: Path, own: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """``path``'s imports of weightcache's private modules (``own``: the prefixes it may import besides the public)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "weightcache" and node.level == 0:
            moved = [alias.name for alias in node.names if alias.name in weightcache.MOVED]
            found += [f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)} (moved: {', '.join(moved)})"] if moved else []
            continue
        elif isinstance(node, ast.ImportFrom) and node.module == "weightcache.conformance" and node.level == 0:
            kit = importlib.import_module(node.module).__all__
            names = [f"{node.module}.{alias.name}" for alias in node.names if alias.name not in kit]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [
            f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}"
            for name in names
            if name.startswith(PRIVATE) and not name.startswith(own)
        ]
    return found


def test_the_adapters_and_examples_import_only_the_public_api():
    """An adapter under adapters/ may import its own package (weightcache.adapters.*) and ``weightcache``; an example
    only ``weightcache``."""
    found = [
        line for path in sorted((ROOT / "adapters").rglob("*.py")) for line in _private_imports(path, ("weightcache.adapters",))
    ]
    found += [line for path in sorted((ROOT / "examples").rglob("*.py")) for line in _private_imports(path, ())]
    assert not found, (
        "imports of private paths or moved names (import the name from its public module, weightcache.adapter for an "
        "adapter; add it to weightcache/adapter.pyi if an adapter needs it):\n" + "\n".join(f"  {line}" for line in found)
    )


def test_a_private_import_is_caught(tmp_path):
    """The check itself: each form of a private import is reported, the public ones are not."""
    module = tmp_path / "adapter.py"
    module.write_text(
        "import weightcache\nfrom weightcache.adapter import hookimpl\nimport weightcache.core.errors\n"
        "from weightcache.core.load.rebind import rebind_module\ndef f():\n    from weightcache.conformance import checks\n"
        "from weightcache import load_model, hookimpl\nfrom weightcache.conformance import ConformanceTests\n"
        "import weightcache.conformance.checks\n"
    )
    found = _private_imports(module, (), root=tmp_path)
    assert sorted(int(line.split(":")[1]) for line in found) == [3, 4, 6, 7, 9], found


def public_names_table() -> str:
    """docs/api.md's table of public names: one row per group of each public module's stub (its comment lines), in the
    stub's order; the kit's names from its ``__all__``."""
    rows = []
    for face in weightcache.FACES:
        group = None
        for line in Path(importlib.util.find_spec(face).origin or "").with_suffix(".pyi").read_text().splitlines():
            if line.startswith("# "):
                group = line[2:]
                rows.append([face, group, []])
            elif line.startswith("from ") and group is not None:
                rows[-1][2] += [name.split(" as ")[0].strip(" ()") for name in line.split(" import ", 1)[1].split(",")]
    kit = importlib.import_module("weightcache.conformance")
    rows.append(
        ["weightcache.conformance", "the kit: test classes an adapter's suite subclasses, its tensor assertions", kit.__all__]
    )
    return "".join(f"| `{face}` | {title} | {', '.join(f'`{name}`' for name in names)} |\n" for face, title, names in rows)


def old_paths_table() -> str:
    """docs/api.md's table of 0.1.0's module paths: where each is now, and what to import instead."""
    from weightcache.core import old_paths

    rows = ["| 0.1.0 path | now (private) | import instead |\n", "|---|---|---|\n"]
    for old, new in sorted({**old_paths.MOVED, **old_paths.FOLDED}.items()):
        instead = old_paths.public_import(new)
        instead = f"`{instead[4:]}`" if instead.startswith("use from weightcache") else "(nothing public: its names are internal)"
        rows.append(f"| `{old}` | `{new}` | {instead} |\n")
    return "".join(rows)


def _between(text: str, marker: str) -> str:
    return text.split(f"<!-- {marker}:begin -->\n", 1)[1].split(f"<!-- {marker}:end -->", 1)[0]


def test_docs_api_lists_every_public_name_and_every_old_path():
    text = (ROOT / "docs" / "api.md").read_text()
    if os.environ.get("WEIGHTCACHE_WRITE_API_SNAPSHOT") == "1":
        for marker, table in (("public-names", public_names_table()), ("old-paths", old_paths_table())):
            head, rest = text.split(f"<!-- {marker}:begin -->\n", 1)
            text = f"{head}<!-- {marker}:begin -->\n{table}<!-- {marker}:end -->{rest.split(f'<!-- {marker}:end -->', 1)[1]}"
        (ROOT / "docs" / "api.md").write_text(text)
    assert _between(text, "public-names") == public_names_table(), (
        "docs/api.md's public names differ from weightcache/__init__.pyi"
    )
    assert _between(text, "old-paths") == old_paths_table(), "docs/api.md's 0.1.0 paths differ from core/old_paths.py"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--socket-dir", "{tmp}/no-server"], ["no-such-command"]])
def test_python_m_weightcache_works_like_the_console_script(argv, tmp_path):
    """Same output, same exit status, through real processes: the console script and ``python -m weightcache``."""
    script = Path(sys.executable).with_name("weightcache")
    args = [arg.format(tmp=tmp_path) for arg in argv]
    by_script = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    by_module = subprocess.run(
        [sys.executable, "-m", "weightcache", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert (by_module.returncode, by_module.stdout, by_module.stderr) == (
        by_script.returncode,
        by_script.stdout,
        by_script.stderr,
    )
    assert by_module.stdout or by_module.stderr


def test_public_errors_name_their_public_module_and_still_pickle(tmp_path):
    """A traceback (``weightcache -v``) names ``weightcache.errors.X``, where a user imports it, not the private
    module; pickling finds the class there (the same class)."""
    import pickle

    import weightcache.errors

    for name in weightcache.errors.__all__:
        cls = getattr(weightcache.errors, name)
        assert cls.__module__ == "weightcache.errors", f"{name} names {cls.__module__}"
    from weightcache.errors import WeightCacheError

    again = pickle.loads(pickle.dumps(WeightCacheError("abc")))
    assert type(again) is WeightCacheError and str(again) == "abc"
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache", "-v", "load", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "\nweightcache.errors.CheckpointNotFound: " in proc.stderr, proc.stderr[-2000:]
