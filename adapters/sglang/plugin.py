"""The ``sglang.srt.plugins`` entry point: ``--load-format weightcache`` in every SGLang process.

SGLang's CLI takes only listed load formats, and its ``LoadConfig`` turns a
string into its ``LoadFormat`` enum (an unknown name raises). So the plugin
adds the choice and registers a hook that, before ``LoadConfig.__post_init__``
checks the format, replaces the name ``weightcache`` by the loader class,
which SGLang accepts as a load format. SGLang applies registered hooks after
running the plugins (``load_plugins``).
"""

from __future__ import annotations

import typing

if typing.TYPE_CHECKING:
    from weightcache.adapters.sglang.engine import LoadConfig

LOAD_FORMAT = "weightcache"
HOOK_TARGET = "sglang.srt.configs.load_config.LoadConfig.__post_init__"

_registered: list[bool] = []


def register() -> None:
    """Add the ``weightcache`` load-format choice and the name-to-class hook, once per process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import LOAD_FORMAT_CHOICES, add_load_format_choices

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    if not _registered:
        HookRegistry.register(HOOK_TARGET, resolve_load_format, HookType.BEFORE)
        _registered.append(True)


def resolve_load_format(load_config: "LoadConfig", *args: typing.Any, **kwargs: typing.Any) -> None:
    """BEFORE ``LoadConfig.__post_init__``: the name ``weightcache`` becomes the loader class."""
    fmt = load_config.load_format
    if isinstance(fmt, str) and fmt.lower() == LOAD_FORMAT:
        from weightcache.adapters.sglang.loader import loader_class

        load_config.load_format = loader_class()
    return None
