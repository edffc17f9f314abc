"""The vLLM adapter: ``--load-format weightcache`` for vLLM 0.33.

vLLM runs ``weightcache.adapters.vllm.plugin:register`` (the ``vllm.general_plugins``
entry point) in each of its processes; it registers the load format. Usage::

    vllm serve MODEL --load-format weightcache --model-loader-extra-config '{"mode": "daemon"}'
    vllm serve MODEL --load-format weightcache --model-loader-extra-config '{"mode": "client"}'

vLLM is imported inside functions only: this package imports without it. See docs/engines.md.
"""
