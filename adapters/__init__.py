"""Built-in adapters, one subpackage per engine.

``hf`` implements weightcache's hooks and registers through the ``weightcache.adapters``
entry points. ``vllm`` and ``sglang`` plug weightcache into each engine's own loader
extension point (``vllm.general_plugins``, ``sglang.srt.plugins``) and share
``engine_modes`` (the off/daemon/client flow around an engine's own load) and
``engine_quantization`` (engine method names onto the allowlist).
"""
