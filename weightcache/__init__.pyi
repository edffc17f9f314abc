"""weightcache's public API for people who load and serve models: each name and the private module that holds it.

``weightcache/__init__.py`` reads this file to serve each name lazily; type checkers read it as the package's stub.
The other audiences have a module each, listed the same way in a stub beside it: ``weightcache.adapter`` (adapter
authors), ``weightcache.engine`` (engine forks and integrations), ``weightcache.refit``, ``weightcache.fleet``,
``weightcache.errors`` (every error) and ``weightcache.conformance`` (the kit). A name added here is public; removing
one (or changing its signature) fails the API snapshot test (tests/test_public_api.py).
"""

from weightcache.core import __version__ as __version__

# load a model through an adapter, in mode off, daemon or client; its options and its result
from weightcache.core.flow.modes import load_model as load_model, LoadedModel as LoadedModel
from weightcache.core.fingerprint import ParallelSpec as ParallelSpec
from weightcache.core.device import Device as Device

# the server, and the socket directory it listens in
from weightcache.core.server.server_process import ServerProcess as ServerProcess
from weightcache.core.socket_dir import SocketDir as SocketDir, SocketDirLike as SocketDirLike

# errors a caller catches: each message says what to do next (every error: weightcache.errors)
from weightcache.core.errors import WeightCacheError as WeightCacheError, ServerUnavailable as ServerUnavailable
from weightcache.core.errors import AccessDenied as AccessDenied, ServerError as ServerError
from weightcache.core.errors import ProtocolError as ProtocolError, EntryNotFound as EntryNotFound
from weightcache.core.errors import FingerprintMismatch as FingerprintMismatch, EntryCorrupt as EntryCorrupt
from weightcache.core.errors import ChecksumMismatch as ChecksumMismatch, EntryUnusable as EntryUnusable
from weightcache.core.errors import CheckpointChanged as CheckpointChanged, CheckpointNotFound as CheckpointNotFound
from weightcache.core.errors import ModelNotCached as ModelNotCached, InvalidCheckpoint as InvalidCheckpoint
from weightcache.core.errors import NotRegularFile as NotRegularFile, UnsupportedQuantization as UnsupportedQuantization
from weightcache.core.errors import AdapterNotFound as AdapterNotFound, InvalidAdapter as InvalidAdapter
from weightcache.core.errors import UnknownOption as UnknownOption, InvalidOption as InvalidOption
from weightcache.core.errors import DeviceNotFound as DeviceNotFound, DeviceUnavailable as DeviceUnavailable
from weightcache.core.errors import BackendUnavailable as BackendUnavailable, CudaError as CudaError, NoRoom as NoRoom
from weightcache.core.errors import NoMemory as NoMemory, VersionNotFound as VersionNotFound
from weightcache.core.errors import LayoutMismatch as LayoutMismatch
