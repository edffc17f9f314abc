"""The kit's pre-check on the real checkpoint: what must hold before any check can mean anything.

Adapter found and well-formed, options known and their values allowed, the
adapter's checkpoint conventions and ``weightcache_describe`` answering with the
right types, the described method allowed. Each needs the configs only (no
weight byte is read). When one fails, no check can pass, so the kit stops the
whole run with one line (``PrecheckFailed``): ``weightcache conformance`` as its
error, ``pytest -p weightcache.conformance`` as a usage error, a subclass of the
kit by stopping the session after the first check.
"""

from __future__ import annotations

import typing

from weightcache.core.errors import UnsupportedQuantization, WeightCacheError
from weightcache.core.request import LoadRequest

if typing.TYPE_CHECKING:
    from weightcache.core.flow.plugins import Plugins


class PrecheckFailed(WeightCacheError):
    """The kit cannot run on this adapter and checkpoint; the message says why and what to fix."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(f"weightcache conformance pre-check failed: {problem}")


def request_from_options(
    adapter: str | None,
    model: str | None,
    quantization: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    options: "typing.Sequence[str]" = (),
) -> LoadRequest:
    """The kit's request from its command-line values (``weightcache conformance`` and ``--weightcache-*``)."""
    from pathlib import Path

    from weightcache.core.options import parse_options

    if not adapter or not model:
        raise PrecheckFailed("name the adapter and the checkpoint (--adapter NAME --model PATH)")
    if not Path(model).exists():
        raise PrecheckFailed(f"--model {model}: no such file or directory")
    try:
        return LoadRequest(
            model=str(Path(model).resolve()),
            adapter=adapter,
            dtype=dtype,
            device=device or "cpu",
            quantization=quantization,
            options=parse_options(list(options)),
        )
    except ValueError as exc:
        raise PrecheckFailed(str(exc)) from None


def precheck(request: LoadRequest, plugins: "Plugins | None" = None) -> None:
    """Raise PrecheckFailed, in one line, unless the kit can run ``request`` at all.

    A quantization method the request asks for and the model refuses is no
    failure here: the kit checks that refusal (and skips what needs the model loaded).
    """
    from weightcache.core.flow.plugins import installed_plugins
    from weightcache.core.quantization.allowlist import check_quantization

    try:
        adapter = (plugins or installed_plugins()).adapter(request.adapter)
        adapter.check_options(request)
        adapter.checkpoint_conventions(request)
    except WeightCacheError as exc:
        raise PrecheckFailed(str(exc)) from None
    try:
        description = adapter.describe(request)
        check_quantization(description.quantization, adapter.quantization_allowlist(request))
    except UnsupportedQuantization as exc:
        if request.quantization in (None, "none"):
            raise PrecheckFailed(
                f"the checkpoint {request.model} cannot be loaded by adapter {request.adapter!r}: {exc}"
            ) from None
    except WeightCacheError as exc:
        raise PrecheckFailed(str(exc)) from None
    except Exception as exc:
        raise PrecheckFailed(
            f"weightcache_describe of adapter {request.adapter!r} failed on {request.model}: {type(exc).__name__}: {exc}; "
            "is this a checkpoint of that adapter? describe reads configs and safetensors headers only"
        ) from None
