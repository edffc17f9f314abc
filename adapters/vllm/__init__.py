"""The vLLM adapter (vLLM 0.33): the ``vllm`` weightcache adapter and ``--load-format weightcache``.

- ``hooks``: the adapter's hooks (registered as ``vllm`` in the ``weightcache.adapters`` entry points);
- ``loader``: ``WeightcacheModelLoader``, which vLLM finds through the ``vllm.general_plugins`` entry point
  (``plugin.register``) and which calls weightcache's one mode runner. Usage::

    vllm serve MODEL --load-format weightcache --model-loader-extra-config '{"mode": "daemon"}'
    vllm serve MODEL --load-format weightcache --model-loader-extra-config '{"mode": "client"}'

vLLM is imported inside functions only: this package imports without it. See docs/engines.md.
"""
