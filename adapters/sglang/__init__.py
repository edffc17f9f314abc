"""The SGLang adapter (SGLang 0.5.23): weightcache's hooks for SGLang, and SGLang's loader plugin point that calls them.

Two ways in::

    # Python: the class itself is a load format
    from weightcache.adapters.sglang.loader import WeightcacheLoader
    sglang.Engine(model_path=MODEL, load_format=WeightcacheLoader, model_loader_extra_config='{"mode": "client"}')

    # CLI: the sglang.srt.plugins entry point adds the name
    sglang serve --model-path MODEL --load-format weightcache --model-loader-extra-config '{"mode": "client"}'

Both run the core's mode runner (``weightcache.core.flow.modes``) over the hooks in
``hooks`` (registered as ``sglang`` in the ``weightcache.adapters`` entry
points, so the conformance kit and ``weightcache load --adapter sglang`` drive
them too). Modules: ``hooks`` (the hook implementations), ``identity`` (what a
model rank is, before loading), ``engine`` (SGLang's configuration objects for
one load), ``loading`` (SGLang's load, post-processing and meta rebuild),
``loader`` and ``plugin`` (SGLang's plugin points), ``internals`` (the private
SGLang names used).

Leave SGLang's own ``--weight-cache-mode`` at ``off``: any other value makes
SGLang replace the load format with its built-in cache. SGLang is imported
inside functions only: this package imports without it. See docs/engines.md.
"""
