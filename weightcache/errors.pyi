"""Every error weightcache raises, each a subclass of ``WeightCacheError`` with a message that says what to do next.

The ones a caller of ``load_model`` catches are also names of ``weightcache`` itself.
"""

# every error
from weightcache.core.errors import WeightCacheError as WeightCacheError, ProtocolError as ProtocolError
from weightcache.core.errors import ServerUnavailable as ServerUnavailable, AccessDenied as AccessDenied
from weightcache.core.errors import ServerError as ServerError, EntryNotFound as EntryNotFound
from weightcache.core.errors import FingerprintMismatch as FingerprintMismatch, EntryCorrupt as EntryCorrupt
from weightcache.core.errors import ChecksumMismatch as ChecksumMismatch, EntryUnusable as EntryUnusable
from weightcache.core.errors import CheckpointChanged as CheckpointChanged, CheckpointNotFound as CheckpointNotFound
from weightcache.core.errors import ModelNotCached as ModelNotCached, InvalidCheckpoint as InvalidCheckpoint
from weightcache.core.errors import InvalidManifest as InvalidManifest
from weightcache.core.errors import UnsupportedQuantization as UnsupportedQuantization
from weightcache.core.errors import AdapterNotFound as AdapterNotFound, InvalidAdapter as InvalidAdapter
from weightcache.core.errors import UnknownOption as UnknownOption, InvalidOption as InvalidOption
from weightcache.core.errors import RebindError as RebindError, ArenaError as ArenaError
from weightcache.core.errors import BackendUnavailable as BackendUnavailable, CudaError as CudaError
from weightcache.core.errors import DeviceNotFound as DeviceNotFound, DeviceUnavailable as DeviceUnavailable
from weightcache.core.errors import NoRoom as NoRoom, NoMemory as NoMemory, StandbyError as StandbyError
from weightcache.core.errors import CompileArtifactsUnavailable as CompileArtifactsUnavailable
from weightcache.core.errors import SeedRefused as SeedRefused, SeedFailed as SeedFailed
from weightcache.core.errors import VersionNotFound as VersionNotFound, LayoutMismatch as LayoutMismatch
from weightcache.core.errors import NotRegularFile as NotRegularFile, FleetUnavailable as FleetUnavailable
from weightcache.core.errors import PullFailed as PullFailed
