"""Built-in adapters, one subpackage per engine; each registers in the ``weightcache.adapters`` entry points.

``hf`` (transformers), ``vllm`` and ``sglang`` implement weightcache's hooks. The
engines' own extension points (``vllm.general_plugins``, SGLang's ``load_format``)
stay how users turn weightcache on; their loader classes call the core's one mode
runner (``weightcache.core.flow.modes``). The engine adapters share ``engine_support``
(engines' process-wide tables, read-only guards, loader-class helpers) and
``engine_quantization`` (engine method names onto the allowlist).
"""
