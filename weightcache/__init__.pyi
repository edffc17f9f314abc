"""weightcache's public API: each name and the private module that holds it, in one list.

``weightcache/__init__.py`` reads this file to serve each name lazily; type checkers read it as the
package's stub. A name added here is public; removing one (or changing its signature) fails the API
snapshot test (tests/test_public_api.py).
"""

from weightcache.core import __version__ as __version__

# engines: one call loads a model through an adapter, in mode off, daemon or client
from weightcache.core.flow.modes import load_model as load_model, LoadedModel as LoadedModel, run as run
from weightcache.core.flow.modes import CacheOptions as CacheOptions, ATTACHMENT_ATTR as ATTACHMENT_ATTR
from weightcache.core.flow.loader import prepare as prepare, Prepared as Prepared
from weightcache.core.flow.loader import publish as publish, Published as Published
from weightcache.core.flow.loader import Origin as Origin, Tier as Tier
from weightcache.core.flow.plugins import Plugins as Plugins

# engine forks that own their model code: fingerprint, publish, attach, rebind
from weightcache.core.flow.api import fingerprint as fingerprint, attach as attach, rebind as rebind
from weightcache.core.flow.api import publish_model as publish_model, publish_state as publish_state
from weightcache.core.flow.api import publish_checkpoint as publish_checkpoint
from weightcache.core.client.attach import Attachment as Attachment

# the adapter contract: the hook marker and the values hooks take and return
from weightcache.core.hookspecs import hookimpl as hookimpl
from weightcache.core.options import AdapterOption as AdapterOption
from weightcache.core.request import LoadRequest as LoadRequest, ModelDescription as ModelDescription
from weightcache.core.request import ForwardUnavailable as ForwardUnavailable
from weightcache.core.request import CheckpointConventions as CheckpointConventions
from weightcache.core.device import Device as Device
from weightcache.core.fingerprint import Fingerprint as Fingerprint, ParallelSpec as ParallelSpec
from weightcache.core.layout.manifest import Manifest as Manifest, TensorRecord as TensorRecord

# helpers an adapter's hooks use: checkpoints and their identity, arenas, rebind
from weightcache.core.identity.safetensors_io import checkpoint_files as checkpoint_files
from weightcache.core.identity.safetensors_io import checkpoint_tensors as checkpoint_tensors, TensorInfo as TensorInfo
from weightcache.core.identity.hub import looks_like_hub_id as looks_like_hub_id
from weightcache.core.identity.digests import DigestStore as DigestStore, default_store as default_store
from weightcache.core.dtypes import to_dtype as to_dtype, dtype_name as dtype_name
from weightcache.core.cpus import usable_cpus as usable_cpus
from weightcache.core.envvars import env_switch as env_switch
from weightcache.core.load.importing import importing as importing
from weightcache.core.load.export import ArenaBuilder as ArenaBuilder, Slot as Slot
from weightcache.core.load.export import export_module as export_module, tensor_attributes as tensor_attributes
from weightcache.core.load.reader import read_checkpoint as read_checkpoint
from weightcache.core.load.rebind import rebind_module as rebind_module, meta_parameters as meta_parameters
from weightcache.core.load.rebind import check_no_meta as check_no_meta

# quantization: the allow-list and block-wise FP8
from weightcache.core.quantization.allowlist import check_quantization as check_quantization
from weightcache.core.quantization.fp8_block import Fp8BlockConfig as Fp8BlockConfig, Fp8BlockLinear as Fp8BlockLinear
from weightcache.core.quantization.fp8_block import quantize_model as quantize_model
from weightcache.core.quantization.fp8_block import convert_model_to_fp8_skeleton as convert_model_to_fp8_skeleton
from weightcache.core.quantization.fp8_block import load_prequantized as load_prequantized
from weightcache.core.quantization.fp8_block import quantize_weight as quantize_weight, dequantize_weight as dequantize_weight

# the server, its socket directory and a connection to it
from weightcache.core.server.server_process import ServerProcess as ServerProcess
from weightcache.core.client.client import Connection as Connection
from weightcache.core.socket_dir import SocketDir as SocketDir, SocketDirLike as SocketDirLike

# engines' fast starts: a warm spare, compile artifacts and compiled forwards beside the weights, an entry seeded to other nodes
from weightcache.core.spare.standby import Standby as Standby
from weightcache.core.spare.compile_cache import publish_artifacts as publish_artifacts
from weightcache.core.spare.compile_cache import restore_artifacts as restore_artifacts
from weightcache.core.spare.compiled_forward import CompiledForward as CompiledForward, compiled_forward as compiled_forward
from weightcache.core.spare.compiled_forward import compile_ahead as compile_ahead, publish_compiled as publish_compiled
from weightcache.core.spare.compiled_forward import restore_compiled as restore_compiled
from weightcache.core.node.seeding import send_entry as send_entry, receive_entry as receive_entry

# live refit: a trainer publishes a new version of a served model from its tensors; engines switch in place
from weightcache.core.refit.publish import publish_version as publish_version, stage_version as stage_version
from weightcache.core.refit.publish import PublishedVersion as PublishedVersion, StagedVersion as StagedVersion

# errors: each message says what to do next
from weightcache.core.errors import WeightCacheError as WeightCacheError, ProtocolError as ProtocolError
from weightcache.core.errors import ServerUnavailable as ServerUnavailable, AccessDenied as AccessDenied
from weightcache.core.errors import ServerError as ServerError, EntryNotFound as EntryNotFound
from weightcache.core.errors import FingerprintMismatch as FingerprintMismatch, EntryCorrupt as EntryCorrupt
from weightcache.core.errors import ChecksumMismatch as ChecksumMismatch, EntryUnusable as EntryUnusable
from weightcache.core.errors import CheckpointChanged as CheckpointChanged, CheckpointNotFound as CheckpointNotFound
from weightcache.core.errors import ModelNotCached as ModelNotCached, InvalidCheckpoint as InvalidCheckpoint
from weightcache.core.errors import InvalidManifest as InvalidManifest, UnsupportedQuantization as UnsupportedQuantization
from weightcache.core.errors import AdapterNotFound as AdapterNotFound, InvalidAdapter as InvalidAdapter
from weightcache.core.errors import UnknownOption as UnknownOption, InvalidOption as InvalidOption
from weightcache.core.errors import RebindError as RebindError, ArenaError as ArenaError
from weightcache.core.errors import BackendUnavailable as BackendUnavailable, CudaError as CudaError
from weightcache.core.errors import DeviceNotFound as DeviceNotFound, DeviceUnavailable as DeviceUnavailable
from weightcache.core.errors import NoRoom as NoRoom, NoMemory as NoMemory
from weightcache.core.errors import StandbyError as StandbyError, CompileArtifactsUnavailable as CompileArtifactsUnavailable
from weightcache.core.errors import SeedRefused as SeedRefused, SeedFailed as SeedFailed
from weightcache.core.errors import VersionNotFound as VersionNotFound, LayoutMismatch as LayoutMismatch
from weightcache.core.errors import NotRegularFile as NotRegularFile
from weightcache.core.errors import FleetUnavailable as FleetUnavailable, PullFailed as PullFailed

# the conformance kit: the test classes an adapter's suite subclasses, and its tensor assertions
from weightcache.conformance import ConformanceFixtures as ConformanceFixtures, ConformanceTests as ConformanceTests
from weightcache.conformance import AdapterTests as AdapterTests, ArchitectureTests as ArchitectureTests
from weightcache.conformance import ParityTests as ParityTests, ModeTests as ModeTests, FlipTests as FlipTests
from weightcache.conformance import FingerprintTests as FingerprintTests, QuantizationTests as QuantizationTests
from weightcache.conformance import CrashTests as CrashTests, RefitTests as RefitTests
from weightcache.conformance.assertions import assert_tensors_identical as assert_tensors_identical
from weightcache.conformance.assertions import model_tensors as model_tensors, tensor_digest as tensor_digest
from weightcache.conformance.assertions import tied_groups as tied_groups
