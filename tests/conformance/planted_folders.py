"""Adapters with one planted bug each that only a multi-folder checkpoint, another file or another thread count shows.

``test_multi_folder.py`` registers them through ``weightcache.adapters`` entry points and runs the kit on them; each
must fail by the check meant for it, naming the file or tensor. ``Folders`` is the control: the example
sentence-transformers adapter (examples/sentence_transformers_adapter.py) as it is, which passes.
"""

from __future__ import annotations

import attrs
import sentence_transformers_adapter as st
import torch
from planted_adapters import Example
from weightcache_example import plugin

from weightcache.adapter import hookimpl


class Folders:
    """The example sentence-transformers adapter, hook for hook."""

    weightcache_checkpoint_files = staticmethod(st.weightcache_checkpoint_files)
    weightcache_describe = staticmethod(st.weightcache_describe)
    weightcache_load = staticmethod(st.weightcache_load)
    weightcache_load_tensors = staticmethod(st.weightcache_load_tensors)
    weightcache_rebind = staticmethod(st.weightcache_rebind)
    weightcache_example_inputs = staticmethod(st.weightcache_example_inputs)
    weightcache_checkpoint_conventions = staticmethod(st.weightcache_checkpoint_conventions)


class DenseLeftOut(Folders):
    """Declares the body's weights only, as the identity covered before: a new ``2_Dense/model.safetensors`` keeps the
    fingerprint, and a client attaches the old head."""

    @staticmethod
    @hookimpl
    def weightcache_checkpoint_files(request):
        declared = st.weightcache_checkpoint_files(request=request)
        return attrs.evolve(declared, weights=declared.weights[:1])


class PoolingLeftOut(Folders):
    """Reads ``1_Pooling/config.json`` (its pooling mode decides the embedding) but declares neither the file nor the mode:
    another pooling mode keeps the fingerprint."""

    @staticmethod
    @hookimpl
    def weightcache_checkpoint_files(request):
        declared = st.weightcache_checkpoint_files(request=request)
        return attrs.evolve(declared, configs=tuple(c for c in declared.configs if "Pooling" not in c))

    @staticmethod
    @hookimpl
    def weightcache_describe(request):
        description = st.weightcache_describe(request=request)
        return attrs.evolve(description, config={k: v for k, v in description.config.items() if k != "pooling"})


class ChunksByThreadCount(Example):
    """TinyLM whose post-processing rescales fc1.weight in as many chunks as torch has threads (a parallel repack whose
    rounding follows the chunking): the loader's thread count decides the bytes an engine with another count attaches."""

    @staticmethod
    @hookimpl
    def weightcache_post_process(request, model, description):
        with torch.no_grad():
            for number, chunk in enumerate(model.fc1.weight.chunk(torch.get_num_threads())):
                chunk.mul_(1.0 + 1e-3 * number)
        return model


class WrittenFor010:
    """TinyLM as an adapter written against 0.1.0's guide might read it: no ``weightcache_checkpoint_conventions`` and
    no notion of a checkpoint-declared quantization (describe says ``none`` whatever config.json holds). The kit must
    not fail it for a convention it never claimed (transformers' ``quantization_config``): it skips, saying what to
    declare."""

    weightcache_load = staticmethod(plugin.weightcache_load)
    weightcache_rebind = staticmethod(plugin.weightcache_rebind)
    weightcache_example_inputs = staticmethod(plugin.weightcache_example_inputs)

    @staticmethod
    @hookimpl
    def weightcache_describe(request):
        description = plugin.weightcache_describe(request=attrs.evolve(request, quantization=None))
        return attrs.evolve(description, quantization=request.quantization or "none", quantization_config={})


class DoublesInBfloat16(Folders):
    """Post-processing in bfloat16 only adds a forward hook that doubles the embedding (a flag an engine sets for bf16
    numerics); rebind never adds it. A kit run at float32 alone sees nothing; an engine in bfloat16 that attaches gets
    other outputs than its own disk load."""

    @staticmethod
    @hookimpl
    def weightcache_post_process(request, model, description):
        if description.dtype == "bfloat16":
            model.register_forward_hook(lambda module, args, output: output * 2)
        return model


class ExtraFollowsTheProcess(Folders):
    """Publishes the order of a set of strings as manifest extra (state rebind would restore, such as the order of a
    module list): ``PYTHONHASHSEED`` decides it, so an engine in another process would compute another one."""

    @staticmethod
    @hookimpl
    def weightcache_manifest_extra(request, model):
        return {"order": list({f"module-{number}" for number in range(24)})}
