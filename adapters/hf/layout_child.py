"""The layout process's child: builds the skeleton of the model its JSON argument names and prints its layout as JSON.

Started by ``layout_process.LayoutProcess`` (``python -m weightcache.adapters.hf.layout_child ARGUMENTS``); exit status 0
with the layout on stdout, 3 where the model's layout cannot be remembered, 4 where the code that built the model
mentions a package this process refuses (``REFUSED``), anything else on an error (on stderr). Whichever, the load
builds the skeleton itself.

It builds the skeleton with the very function a load in the parent would use (``loading.skeleton_and_layout``), and is
made faster only by what a one-shot process may skip, set up in :func:`prepare` before torch
is imported:

- the cyclic garbage collector is off: importing ~3,000 modules runs thousands of collections that find next to
  nothing to free;
- the packages in ``REFUSED`` import as if they were not installed; the layout is refused (status 4) where any
  transformers module this process loaded, but for those named in ``REFUSED``, mentions one of them;
- it ends with ``os._exit`` once the layout is flushed, skipping the interpreter's teardown of those modules (the
  parent reads the layout when the child's pipes close).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import typing

if typing.TYPE_CHECKING:
    from types import ModuleType

    from weightcache.adapters.hf.layout import Layout

_AVAILABILITY = ("transformers", "transformers.utils", "transformers.utils.import_utils", "transformers.file_utils")
"""transformers' availability checks (``is_sklearn_available``) and the modules that re-export them."""

REFUSED: dict[str, tuple[str, ...]] = {
    "sklearn": (
        *_AVAILABILITY,
        "transformers.generation.candidate_generator",  # assisted generation's confidence threshold (roc_curve)
        "transformers.data.metrics",  # the GLUE/XNLI metrics
    ),
    "scipy": (
        *_AVAILABILITY,
        "transformers.dependency_versions_table",  # a table of version pins
        "transformers.loss.",  # training losses (the detection models' Hungarian matching), computed in forward
    ),
}
"""Packages the child imports as if they were not installed, each with the transformers modules (a name ending in
``.``: the modules under it) known to use it only outside building a model; a loaded module beyond those that mentions
one makes the child refuse the layout (FNet, whose DFT buffers scipy computes, is learned by the load itself).
transformers 5.17 imports scikit-learn (with scipy.stats and pandas: ~740 modules) at the top of its generation
utilities, which every model class with ``generate`` needs; 5.24 imports it only where assisted generation calls it.
Both import scipy.optimize (~320 modules) with the losses, which every ``PreTrainedModel`` module imports."""


def _known_user(module: str, users: tuple[str, ...]) -> bool:
    return any(module == user or (user.endswith(".") and module.startswith(user)) for user in users)


EXIT_NO_LAYOUT = 3
EXIT_REFUSED = 4


class RefusedPackage(RuntimeError):
    """The code that built the model mentions a package the child refused: its layout could differ from the parent's."""


def prepare(refused: typing.Iterable[str] = REFUSED) -> None:
    """Set this process up to learn one layout fast: the garbage collector off, the ``refused`` packages missing.

    Process-wide and for good: call it first thing in a process that only learns layouts.
    """
    gc.disable()
    for name in refused:
        # None: `import name` raises ImportError, importlib.util.find_spec(name) is None (transformers: not available)
        typing.cast("dict[str, ModuleType | None]", sys.modules).setdefault(name, None)


def learn(arguments: dict, refused: typing.Mapping[str, tuple[str, ...]] = REFUSED) -> "Layout | None":
    """The layout of the skeleton of the model ``arguments`` name (None where it cannot be remembered), built as a
    load builds it; RefusedPackage where a transformers module loaded meanwhile mentions a ``refused`` package."""
    from weightcache.adapter import LoadRequest
    from weightcache.adapters.hf import identity, loading

    request = LoadRequest(
        model=arguments["model"],
        dtype=arguments["dtype"],
        quantization=arguments["quantization"],
        options=tuple(tuple(pair) for pair in arguments["options"]),
    )
    dtype = identity.load_dtype(request, identity.read_config(request.model))
    _, learned = loading.skeleton_and_layout(request, dtype)
    check_refused_unused(refused)
    return learned


def check_refused_unused(refused: typing.Mapping[str, tuple[str, ...]] = REFUSED) -> None:
    """RefusedPackage where the source of a loaded transformers module, but for the ones known to use it, names a
    ``refused`` package (a model that would compute a buffer with it, as FNet does with scipy)."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "transformers" or name.startswith(("transformers.", "transformers_modules."))):
            continue
        origin = getattr(getattr(module, "__spec__", None), "origin", None) or ""
        if not origin.endswith(".py"):
            continue
        with open(origin, "rb") as file:
            source = file.read()
        found += [
            f"{name} mentions {package}"
            for package, users in refused.items()
            if not _known_user(name, users) and package.encode() in source
        ]
    if found:
        raise RefusedPackage(
            f"{'; '.join(sorted(found))}: this process imports it as missing, so the layout could differ; the load builds "
            "the skeleton itself (a module that uses the package only outside building a model belongs in "
            "layout_child.REFUSED)"
        )


def main(argv: list[str], refused: typing.Mapping[str, tuple[str, ...]] = REFUSED) -> int:
    """Learn the layout the JSON argument names and print it as JSON; the exit status (see the module's docstring)."""
    try:
        learned = learn(json.loads(argv[0]), refused)
    except RefusedPackage as exc:
        print(exc, file=sys.stderr)
        return EXIT_REFUSED
    if learned is None:
        print("this model's layout cannot be remembered (Layout.of_model); the load builds its skeleton", file=sys.stderr)
        return EXIT_NO_LAYOUT
    sys.stdout.buffer.write(learned.to_json())
    return 0


if __name__ == "__main__":
    prepare()
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
