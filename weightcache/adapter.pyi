"""weightcache for adapter authors: the hook marker, the values hooks take and return, and the helpers hooks use.

An adapter is a pluggy plugin registered in the ``weightcache.adapters`` entry-point group (docs/adapter-guide.md):
``from weightcache.adapter import hookimpl, ModelDescription``. The conformance kit that proves an adapter right is
``weightcache.conformance``. Each name loads its module on first use.
"""

# the hook marker and the values hooks take and return
from weightcache.core.hookspecs import hookimpl as hookimpl
from weightcache.core.options import AdapterOption as AdapterOption
from weightcache.core.request import LoadRequest as LoadRequest, ModelDescription as ModelDescription
from weightcache.core.request import ForwardUnavailable as ForwardUnavailable
from weightcache.core.request import CheckpointConventions as CheckpointConventions
from weightcache.core.identity.declared import CheckpointFiles as CheckpointFiles
from weightcache.core.device import Device as Device
from weightcache.core.fingerprint import Fingerprint as Fingerprint, ParallelSpec as ParallelSpec
from weightcache.core.layout.manifest import Manifest as Manifest, TensorRecord as TensorRecord

# checkpoints and their identity
from weightcache.core.identity.safetensors_io import checkpoint_files as checkpoint_files
from weightcache.core.identity.safetensors_io import checkpoint_tensors as checkpoint_tensors, TensorInfo as TensorInfo
from weightcache.core.identity.hub import looks_like_hub_id as looks_like_hub_id
from weightcache.core.identity.digests import DigestStore as DigestStore, default_store as default_store
from weightcache.core.dtypes import to_dtype as to_dtype, dtype_name as dtype_name
from weightcache.core.load.reader import read_checkpoint as read_checkpoint
from weightcache.core.load.importing import importing as importing
from weightcache.core.cpus import usable_cpus as usable_cpus
from weightcache.core.envvars import env_switch as env_switch

# arenas and rebind: where the weights go, and how a model built on meta points at them
from weightcache.core.load.export import ArenaBuilder as ArenaBuilder, Slot as Slot, export_module as export_module
from weightcache.core.load.export import tensor_attributes as tensor_attributes
from weightcache.core.load.rebind import rebind_module as rebind_module, meta_parameters as meta_parameters
from weightcache.core.load.rebind import check_no_meta as check_no_meta

# quantization: the registry of methods (plugins), the allow-list and block-wise FP8
from weightcache.core.quantization.method import QuantizationMethod as QuantizationMethod
from weightcache.core.quantization.method import quantization_method as quantization_method
from weightcache.core.quantization.method import quantization_methods as quantization_methods
from weightcache.core.quantization.method import quantization_names as quantization_names
from weightcache.core.quantization.method import declared_quantization as declared_quantization
from weightcache.core.quantization.allowlist import check_quantization as check_quantization
from weightcache.core.quantization.fp8_block import Fp8BlockConfig as Fp8BlockConfig, Fp8BlockLinear as Fp8BlockLinear
from weightcache.core.quantization.fp8_block import quantize_model as quantize_model
from weightcache.core.quantization.fp8_block import convert_model_to_fp8_skeleton as convert_model_to_fp8_skeleton
from weightcache.core.quantization.fp8_block import load_prequantized as load_prequantized
from weightcache.core.quantization.fp8_block import quantize_weight as quantize_weight
from weightcache.core.quantization.fp8_block import dequantize_weight as dequantize_weight

# errors a hook raises
from weightcache.core.errors import InvalidCheckpoint as InvalidCheckpoint, InvalidManifest as InvalidManifest
from weightcache.core.errors import UnsupportedQuantization as UnsupportedQuantization, RebindError as RebindError
from weightcache.core.errors import ArenaError as ArenaError
