"""The SGLang adapter: a model loader for SGLang 0.5.23, as a class or as ``--load-format weightcache``.

Two ways in::

    # Python: the class itself is a load format
    from weightcache.adapters.sglang.loader import WeightcacheLoader
    sglang.Engine(model_path=MODEL, load_format=WeightcacheLoader, model_loader_extra_config='{"mode": "client"}')

    # CLI: the sglang.srt.plugins entry point adds the name
    sglang serve --model-path MODEL --load-format weightcache --model-loader-extra-config '{"mode": "client"}'

Leave SGLang's own ``--weight-cache-mode`` at ``off``: any other value makes
SGLang replace the load format with its built-in cache. SGLang is imported
inside functions only: this package imports without it. See docs/engines.md.
"""
