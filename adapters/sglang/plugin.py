"""The ``sglang.srt.plugins`` entry point: ``--load-format weightcache`` in every SGLang process.

SGLang's CLI takes only listed load formats, and its ``LoadConfig`` turns a
string into its ``LoadFormat`` enum (an unknown name raises). So the plugin
adds the choice and registers a hook that, before ``LoadConfig`` checks the
format, replaces the name ``weightcache`` by the loader class, which SGLang
accepts as a load format. SGLang applies registered hooks after running the
plugins (``load_plugins``).
"""

from __future__ import annotations

LOAD_FORMAT = "weightcache"
HOOK_TARGET = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"


def register() -> None:
    """Add the ``weightcache`` load-format choice and the name-to-class hook (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import LOAD_FORMAT_CHOICES, add_load_format_choices

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    registered = HookRegistry._hooks.get(HOOK_TARGET, [])
    if not any(hook is resolve_load_format for _type, hook, _source in registered):
        HookRegistry.register(HOOK_TARGET, resolve_load_format, HookType.BEFORE)


def resolve_load_format(load_config, *args, **kwargs):
    """BEFORE ``LoadConfig._verify_load_format``: the name ``weightcache`` becomes the loader class."""
    fmt = load_config.load_format
    if isinstance(fmt, str) and fmt.lower() == LOAD_FORMAT:
        from weightcache.adapters.sglang.loader import loader_class

        load_config.load_format = loader_class()
    return None
