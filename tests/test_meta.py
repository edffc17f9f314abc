"""Project-wide checks: light imports, documented hooks, packaging layout."""

from __future__ import annotations

import ast
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import weightcache
import weightcache.adapters
import weightcache.conformance
import weightcache.core
from weightcache.core import hookspecs

ROOT = Path(__file__).resolve().parents[1]


def all_modules() -> list[str]:
    names = ["weightcache.__main__", "weightcache._faces", *weightcache.FACES]  # the public modules (weightcache/)
    for package in (weightcache.core, weightcache.adapters, weightcache.conformance):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    return sorted(names)


@pytest.mark.parametrize("module", all_modules())
def test_every_module_imports_cleanly_without_engines(module):
    """Each module imports with warnings as errors, and vLLM/SGLang are never needed to import."""
    code = f"import sys, importlib; sys.modules['vllm'] = None; sys.modules['sglang'] = None; importlib.import_module({module!r})"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_importing_core_and_the_server_does_not_import_torch():
    code = "import sys, weightcache.core.server.server, weightcache.core.client.client, weightcache.core.cli.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False", "the server and the CLI's import must stay light (no torch)"


# What an engine's start and the CLI import from weightcache must stay light: a restart waits for every import.
LIGHT_MODULES = {
    "weightcache.core.cli.cli": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.client.client": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.flow.modes": ("transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.spare.standby": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.spare.warm": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.spare.compile_cache": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.spare.compiled_forward": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.spare.launch": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.cli.launch": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
    "weightcache.core.spare.launcher": ("torch", "transformers", "weightcache.conformance", "weightcache.adapters"),
}


@pytest.mark.parametrize("module", sorted(LIGHT_MODULES))
def test_the_cli_and_the_client_path_import_neither_transformers_nor_the_kit(module):
    heavy = LIGHT_MODULES[module]
    code = f"import sys, {module}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing {module} imported {out}: import them inside the functions that need them"


def test_the_standby_commands_help_imports_no_framework():
    code = (
        "import sys\nfrom weightcache.core.cli.cli import main\ntry:\n    main(['standby', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'pytest') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip().splitlines()
    assert "--watch-pid" in "\n".join(out) and out[-1] == "[]", out


def _hook_specs():
    return [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("weightcache_")]


def test_every_hook_spec_is_documented_with_params_and_returns():
    specs = _hook_specs()
    assert len(specs) >= 10
    for spec in specs:
        doc = inspect.getdoc(spec) or ""
        assert doc.split("\n")[0], f"{spec.__name__} has no one-line contract"
        for param in inspect.signature(spec).parameters:
            assert f":param {param}:" in doc, f"{spec.__name__} does not document {param}"
        assert ":returns:" in doc, spec.__name__
        firstresult = spec.weightcache_spec["firstresult"]
        assert ("Stops at first non-None result" in doc) == firstresult, (
            f"{spec.__name__}: say whether it stops at the first result"
        )


def test_every_hook_is_documented_in_the_adapter_guide_and_exercised_by_its_own_test():
    """datasette's habit: each hook spec has a test named after it that calls it through a real adapter."""
    guide = (ROOT / "docs" / "adapter-guide.md").read_text()
    hook_tests = (ROOT / "tests" / "core" / "test_hooks.py").read_text()
    for spec in _hook_specs():
        assert f"`{spec.__name__}" in guide, f"docs/adapter-guide.md does not describe {spec.__name__}"
        assert f"def test_hook_{spec.__name__}(" in hook_tests, f"tests/core/test_hooks.py has no test_hook_{spec.__name__}"


def test_no_top_level_core_or_adapters_module_is_installed():
    import importlib.util

    for name in ("core", "adapters", "conformance"):
        spec = importlib.util.find_spec(name)
        assert spec is None or Path(spec.origin or "").parent.parent == ROOT, f"a top-level module {name!r} is installed"


def test_a_plain_install_puts_everything_under_the_weightcache_namespace(tmp_path):
    """`pip install .` (not editable): weightcache.core/adapters/conformance, no top-level core or adapters."""
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    top = {p.name for p in target.iterdir()}
    assert "weightcache" in top and not top & {"core", "adapters", "conformance"}, sorted(top)
    core_packages = [str(p.parent.relative_to(ROOT)) for p in sorted((ROOT / "core").rglob("__init__.py"))]
    for package in (*core_packages, "adapters/hf", "conformance"):
        assert (target / "weightcache" / package / "__init__.py").exists(), package
    for face in ("__init__.py", "__init__.pyi", "__main__.py"):  # the public API and its list of names
        assert (target / "weightcache" / face).exists(), face
    entry_points = next(target.glob("weightcache-*.dist-info")).joinpath("entry_points.txt").read_text()
    assert "hf = weightcache.adapters.hf.hooks" in entry_points and "weightcache = weightcache.core.cli.cli:entry" in entry_points


def test_the_adapter_guide_shows_the_example_adapter_as_it_is():
    """The guide's copy of examples/tinylm-adapter's plugin module is the file itself, so the guide never drifts."""
    guide = (ROOT / "docs" / "adapter-guide.md").read_text()
    shown = guide.split("<!-- example-plugin:begin -->\n```python\n", 1)[1].split("```\n<!-- example-plugin:end -->", 1)[0]
    assert shown == (ROOT / "examples" / "tinylm-adapter" / "src" / "weightcache_example" / "plugin.py").read_text()


def _is_exempt(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Private names, tests, pytest hooks, fixtures and hook implementations (typed by their spec in core/hookspecs.py)."""
    if function.name.startswith(("_", "test_", "pytest_")):
        return True
    for decorator in function.decorator_list:
        name = ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator)
        if name.endswith("hookimpl") or name in ("pytest.fixture", "fixture"):
            return True
    return False


def _unannotated(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters (self and cls aside) and the return that ``function`` leaves without an annotation."""
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    if positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    starred = [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
    missing = [a.arg for a in positional + arguments.kwonlyargs + starred if a.annotation is None]
    return missing + (["return"] if function.returns is None else [])


def test_every_public_function_is_annotated():
    """Every public function and method in weightcache/, core/, adapters/ and conformance/ annotates each parameter and
    its return."""
    found, problems = 0, []
    for package in ("weightcache", "core", "adapters", "conformance"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_exempt(node):
                    found += 1
                    missing = _unannotated(node)
                    if missing:
                        problems.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({', '.join(missing)})")
    assert found > 300, f"found only {found} public functions: has the layout changed?"
    assert not problems, f"{len(problems)} public functions lack annotations:\n  " + "\n  ".join(problems)
