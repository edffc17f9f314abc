"""Named errors of weightcache; each message says what to do next."""

from __future__ import annotations

import os
import typing

from weightcache.core.socket_dir import SocketDir


class WeightCacheError(Exception):
    """Base class of every error weightcache raises on purpose."""


class ProtocolError(WeightCacheError):
    """A frame broke the wire format (bad magic, version, size, JSON, fds).

    ``code`` is the error code the server answers with before it closes the connection.
    """

    code = "protocol_error"


class FrameRefused(ProtocolError):
    """A well-formed frame would exceed what the server holds for unfinished frames (fds or bytes in flight)."""

    code = "busy"


class IdleTimeout(TimeoutError):
    """No frame began within the idle time."""


class ServerUnavailable(WeightCacheError):
    """No server answers on the socket.

    The hint names the command that starts one on the same directory: ``weightcache serve``
    for the default directory, else with ``--socket-dir`` as the caller named it.
    """

    def __init__(self, socket_path: str, reason: str):
        self.socket_path = socket_path
        self.reason = reason
        super().__init__(f"no weightcache server at {socket_path} ({reason}); start one with `{serve_command(socket_path)}`")


def serve_command(socket_path: "str | os.PathLike") -> str:
    """``weightcache serve`` with the ``--socket-dir`` that serves ``socket_path`` (a socket or its directory)."""
    return SocketDir.of_socket(socket_path).serve_command()


class ListenerUnavailable(WeightCacheError):
    """The server cannot listen where it was told to (``what``: the option; ``address``: where); nothing was left bound."""

    def __init__(self, what: str, address: str, reason: str):
        self.what, self.address, self.reason = what, address, reason
        super().__init__(f"cannot listen on {address} ({what}): {reason}")


class AccessDenied(WeightCacheError):
    """The peer or the socket directory failed an ownership or permission check."""


class ServerError(WeightCacheError):
    """The server answered a request with an error.

    ``retry_after_s``: set when the server asked for the same request again after that long (a handover in progress).
    """

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        self.code = code
        self.retry_after_s = retry_after_s
        super().__init__(f"server refused the request ({code}): {message}")


class EntryNotFound(WeightCacheError):
    """No cached entry matches the fingerprint.

    ``fields`` names the fingerprint fields in which the closest entry differs
    (empty when the server holds no entry for this model at all).
    """

    def __init__(self, digest: str, fields: tuple[str, ...] = (), closest: str | None = None, unverified: bool = False):
        self.digest = digest
        self.fields = tuple(fields)
        self.closest = closest
        self.unverified = unverified
        if unverified:
            super().__init__(
                f"the cached entry {digest[:12]} came back after a server crash and is not verified yet, so it is "
                "served only to clients that checksum it first; attach with this weightcache version, or run "
                "`weightcache verify`"
            )
            return
        if fields:
            detail = f"the closest entry, {(closest or '?')[:12]}, differs in: {', '.join(fields)}"
        else:
            detail = "the server holds no entry for this model"
        super().__init__(f"no cached entry for fingerprint {digest[:12]}: {detail}; publish one with `weightcache load`")


class FingerprintMismatch(EntryNotFound):
    """An entry for this model exists, but its fingerprint differs in ``fields``."""


class CheckpointChanged(WeightCacheError):
    """A weight file changed between fingerprinting and the end of loading; nothing was published."""

    def __init__(self, checkpoint: str, file: str):
        self.checkpoint = checkpoint
        self.file = file
        super().__init__(
            f"{file} changed while {checkpoint} was being loaded; nothing was published. "
            "Load it again once the checkpoint is written completely"
        )


class ReaderFailed(WeightCacheError):
    """The reader process a load read its checkpoint through ended or answered out of turn (``reason`` says how)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"the reader process failed: {reason}; nothing was published. Load again, or set "
            "WEIGHTCACHE_READ_PROCESS=0 to read in the loading process"
        )


class EntryUnusable(WeightCacheError):
    """The server handed over an entry this process cannot decode, view or map (``reason`` says why)."""

    def __init__(self, digest: str, reason: str):
        self.digest = digest
        self.reason = reason
        super().__init__(
            f"the cached entry {digest[:12]} cannot be used here: {reason}; load from disk, or evict it "
            f"(`weightcache evict --force {digest[:12]}`) and publish it again"
        )


class InvalidManifest(WeightCacheError, ValueError):
    """A manifest that no client could view: ``tensor`` and ``field`` name the first fault found.

    ``tensor`` is empty when the fault is not in a tensor record (an arena, an alias).
    """

    def __init__(self, tensor: str, field: str, problem: str):
        self.tensor = tensor
        self.field = field
        self.problem = problem
        where = f"tensor {tensor!r:.120} field {field!r}" if tensor else f"field {field!r}"
        super().__init__(
            f"invalid manifest: {where}: {problem}; the publisher's export is broken "
            "(fix the adapter that built it; docs/protocol.md lists the rules)"
        )


class AmbiguousDigest(WeightCacheError):
    """A digest prefix matches more than one entry; ``matches`` lists their digests."""

    SHOWN = 20

    def __init__(self, prefix: str, matches: list[str] | tuple[str, ...]):
        self.prefix = prefix
        self.matches = tuple(matches)
        shown = ", ".join(digest[:12] for digest in self.matches[: self.SHOWN])
        more = f" and {len(self.matches) - self.SHOWN} more" if len(self.matches) > self.SHOWN else ""
        super().__init__(
            f"digest prefix {prefix!r:.80} matches {len(self.matches)} entries ({shown}{more}); "
            "give more characters of the digest (`weightcache status` lists them)"
        )


class UnsupportedQuantization(WeightCacheError):
    """The quantization method is not validated for zero-copy caching."""

    def __init__(self, method: str, reason: str):
        self.method = method
        self.reason = reason
        super().__init__(
            f"quantization method {method!r} is not supported by weightcache: {reason}. "
            "Load this model without weightcache (mode 'off'), or see docs/quantization.md "
            "for what it takes to validate a method."
        )


class AdapterNotFound(WeightCacheError):
    """No usable adapter has the requested name; the message says what is installed, broken, blocked or lacks its engine."""

    def __init__(
        self,
        name: str,
        installed: "typing.Sequence[str]" = (),
        broken: "typing.Mapping[str, str] | None" = None,
        blocked: bool = False,
        missing: "typing.Sequence[str]" = (),
    ):
        self.name = name
        self.installed = tuple(installed)
        self.broken = dict(broken or {})
        self.missing = tuple(missing)
        if self.missing:
            detail = f"it needs {' and '.join(self.missing)}, which is not installed here; `pip install {' '.join(self.missing)}`"
        elif name in self.broken:
            detail = f"it is installed but broken ({self.broken[name]}); fix or reinstall its package"
        elif blocked:
            detail = "it is blocked by $WEIGHTCACHE_BLOCK_ADAPTERS; remove it from that list to use it"
        else:
            detail = "install the package that provides it (it registers in the 'weightcache.adapters' entry points)"
        opening = f"the {name!r} adapter is not usable" if self.missing else f"no weightcache adapter named {name!r}"
        super().__init__(f"{opening}: {detail}. Usable adapters: {', '.join(self.installed) or 'none'}")


class InvalidAdapter(WeightCacheError):
    """An adapter module breaks the hook contract; ``problems`` lists each defect, ``hook`` names the hook if one is at fault."""

    def __init__(self, name: str, problems: "typing.Sequence[str]", hook: str | None = None):
        self.name = name
        self.problems = tuple(problems)
        self.hook = hook
        where = f"{hook} of adapter {name!r}" if hook else f"adapter {name!r}"
        super().__init__(
            f"{where} does not fit the weightcache hook contract: {'; '.join(self.problems)} (see docs/adapter-guide.md)"
        )


class UnknownOption(WeightCacheError):
    """A load asked an adapter for options it does not declare (``weightcache_options``)."""

    def __init__(self, adapter: str, unknown: "typing.Sequence[str]", known: "typing.Mapping[str, str]"):
        self.adapter = adapter
        self.unknown = tuple(unknown)
        self.known = dict(known)
        offered = ", ".join(f"{k} ({v})" for k, v in sorted(self.known.items())) or "none"
        super().__init__(f"adapter {adapter!r} takes no option {', '.join(map(repr, self.unknown))}; its options: {offered}")


class InvalidOption(WeightCacheError, ValueError):
    """A load gave an adapter option a value its declaration (``weightcache_options``) does not allow."""

    def __init__(self, adapter: str, option: str, value: typing.Any, problem: str, help_text: str = ""):
        self.adapter = adapter
        self.option = option
        self.value = value
        self.problem = problem
        about = f" ({help_text})" if help_text else ""
        super().__init__(
            f"adapter {adapter!r} option {option!r} = {value!r:.80}: {problem}{about}; pass a value of that kind or leave the option out"
        )


class RebindError(WeightCacheError):
    """Mapped tensors do not fit the model (missing, extra, wrong shape, left on meta)."""


class ArenaError(WeightCacheError):
    """An arena could not be created, mapped or used."""


class ArenaClosed(ArenaError):
    """The arena was closed in this process; map it again from an fd."""


class BackendUnavailable(ArenaError):
    """An arena backend cannot run in this process (a missing package or device)."""

    def __init__(self, backend: str, reason: str):
        self.backend = backend
        self.reason = reason
        super().__init__(f"the {backend!r} arena backend cannot run here: {reason}")


class CudaError(ArenaError):
    """A CUDA driver call failed; ``call`` names it, ``result`` is the CUresult name."""

    def __init__(self, call: str, result: str, hint: str = ""):
        self.call = call
        self.result = result
        super().__init__(f"{call} failed with {result}" + (f"; {hint}" if hint else ""))


class DeviceNotFound(ArenaError):
    """No GPU visible to this process has the UUID an arena names.

    ``visible`` lists the UUIDs this process can see, in index order.
    """

    def __init__(self, device: str, visible: tuple[str, ...] | list[str]):
        self.device = device
        self.visible = tuple(visible)
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        super().__init__(
            f"no visible GPU is {device}; visible: {', '.join(self.visible) or 'none'} "
            f"(CUDA_VISIBLE_DEVICES={cvd}). Run on the node that holds the arena and make that GPU visible."
        )


class CheckpointNotFound(WeightCacheError, FileNotFoundError):
    """The checkpoint path does not exist or holds no safetensors file."""

    def __init__(self, path: "str | os.PathLike", problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(
            f"{self.path}: {problem}; pass a checkpoint directory that holds *.safetensors files (save_pretrained writes them)"
        )


class ModelNotCached(CheckpointNotFound):
    """A hub id (``org/name``) that the local hub cache does not hold (at that revision)."""

    def __init__(self, repo_id: str, revision: str | None, cache_dir: str):
        self.path = repo_id
        self.revision = revision
        at = f" at revision {revision}" if revision else ""
        self.problem = f"not in the local hub cache{at} ({cache_dir})"
        WeightCacheError.__init__(
            self,
            f"{repo_id}{at} is no directory here and not in the local hub cache ({cache_dir}); download it first (`hf download {repo_id}`), "
            "point HF_HUB_CACHE or HF_HOME at the cache that holds it, or pass the checkpoint directory",
        )


class InvalidCheckpoint(WeightCacheError, ValueError):
    """A checkpoint file weightcache cannot read: a damaged header, a length other than its header says, a dtype it does not handle."""

    DAMAGED = "the file is damaged; copy or download the checkpoint again"

    def __init__(self, file: "str | os.PathLike", problem: str, fix: str = DAMAGED):
        self.file = str(file)
        self.problem = problem
        super().__init__(f"{self.file}: {problem}; {fix}")


class NotRegularFile(InvalidCheckpoint):
    """A weights file that is a FIFO, a device, a socket or a directory: reading it could block or never end."""

    def __init__(self, file: "str | os.PathLike", kind: str):
        self.kind = kind
        super().__init__(
            file, f"it is {kind}, not a regular file", fix="put the weights file itself there (a symlink to one is fine)"
        )


class DeviceUnavailable(WeightCacheError):
    """A load asked for a GPU this process cannot use (no CUDA, or not that index or UUID)."""

    def __init__(self, device: str, reason: str):
        self.device = device
        self.reason = reason
        super().__init__(f"device {device!r} is not available here: {reason}; use device 'cpu', or run where that GPU is visible")


class NoRoom(WeightCacheError):
    """The server's byte budget cannot hold the entry even after evicting every idle entry (checked before loading)."""

    def __init__(self, needed: int, budget: int, attached: int, which: str = "budget", flag: str = "--byte-budget"):
        from weightcache.core.progress import format_bytes

        self.needed = needed
        self.budget = budget
        self.attached = attached
        super().__init__(
            f"the model needs at least {format_bytes(needed)} but the server can make room for only "
            f"{format_bytes(max(budget - attached, 0))} (its {which} is {format_bytes(budget)}, {format_bytes(attached)} of it "
            f"held by entries engines have attached); nothing was loaded. Restart the server with a larger {flag}, "
            "detach engines, or evict entries (`weightcache status` lists them)"
        )


class DemoStepFailed(WeightCacheError):
    """A process of ``weightcache demo`` failed; it printed its own error above."""

    def __init__(self, step: str, returncode: int):
        self.step = step
        self.returncode = returncode
        super().__init__(f"the demo step '{step}' failed (exit {returncode}); its error is printed above")


class CompileArtifactsUnavailable(WeightCacheError):
    """Compile artifacts could not be kept beside an entry or restored from it (``reason`` says why)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"compile artifacts unavailable: {reason}; the engine compiles from scratch (pass strict=False to go on with a warning)"
        )


class StandbyError(WeightCacheError):
    """A warm spare could not get ready (no entry to attach, no forward to warm up with, a bad --then or --watch-pid)."""


class LauncherError(WeightCacheError):
    """A launcher could not start, or could not serve a request (``weightcache launcher``, ``weightcache launch``)."""


class LaunchRefused(WeightCacheError):
    """A launcher will not start this engine as a fork (``reason``: ``stale_code``, ``environment``, ``interpreter``,
    ``fork_unsafe``, ``access_denied``, ``retired``, ``target`` or ``bad_request``); ``weightcache launch`` then execs
    the engine itself."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


class SeedRefused(WeightCacheError):
    """A node cannot use the entry a peer offers it (``fields``: the environment fields that differ); nothing was published."""

    def __init__(self, digest: str, reason: str, fields: "typing.Sequence[str]" = ()):
        self.digest = digest
        self.reason = reason
        self.fields = tuple(fields)
        super().__init__(
            f"this node cannot use the entry {digest[:12]} its peer offers: {reason}; nothing was published. "
            "Seed from a node of the same software and GPU kind, or load the checkpoint here (`weightcache load`)"
        )


class SeedFailed(WeightCacheError):
    """Seeding an entry from a peer broke off (the sender died or stalled, a peer refused); nothing was published."""

    def __init__(self, src: int, reason: str):
        self.src = src
        self.reason = reason
        super().__init__(
            f"seeding from rank {src} failed: {reason}; nothing was published. "
            "Check the other ranks' output, then run `weightcache seed` again on every rank"
        )


class ChecksumMismatch(WeightCacheError):
    """Bytes that moved do not match the checksum their source declared (``arena``: its index); nothing was published.

    ``source`` names where the bytes came from (``peer GPU GPU-8f3e2a1b``, ``the host tier``,
    ``rank 0``, ``this engine's mapping``); ``expected`` is the declared checksum (None: none
    was declared), ``actual`` the checksum of the bytes that arrived.
    """

    def __init__(self, arena: int, source: str, expected: str | None, actual: str, fix: str = ""):
        self.arena = arena
        self.source = source
        self.expected = expected
        self.actual = actual
        declared = f"{source} declared {expected}" if expected else f"{source} declared no checksum"
        super().__init__(
            f"arena {arena} from {source} does not hold the bytes it declared (their checksum is {actual}, {declared}); "
            f"nothing was published. {fix or 'Its copy is corrupt: evict it (`weightcache verify --drop`) and load the model from disk'}"
        )


class EntryCorrupt(ChecksumMismatch):
    """An entry not verified since a server crash does not hold the bytes its manifest declares; it was not used here.

    ``attached_pids``: the engines that keep it attached, so that it stays on the server; ``dropped``: it is gone.
    """

    def __init__(
        self,
        digest: str,
        arena: int,
        expected: str | None,
        actual: str,
        attached_pids: "typing.Sequence[int]" = (),
        dropped: bool = True,
    ):
        self.digest = digest
        self.attached_pids = tuple(attached_pids)
        self.dropped = dropped and not self.attached_pids
        if not dropped and not self.attached_pids:
            after = f"it could not be dropped from the server: run `weightcache verify --drop {digest[:12]}`"
        elif self.attached_pids:
            after = (
                f"it stays on the server, attached by pids {list(self.attached_pids)}: restart those engines from disk and "
                f"run `weightcache verify --drop --force {digest[:12]}`"
            )
        else:
            after = "it was dropped from the server"
        WeightCacheError.__init__(
            self,
            f"the cached entry {digest[:12]} came back after a server crash with other bytes: arena {arena}'s checksum is "
            f"{actual}, its manifest declares {expected}; this process did not use it and {after}",
        )
        self.arena, self.source, self.expected, self.actual = arena, f"entry {digest[:12]}", expected, actual


class NoMemory(WeightCacheError):
    """A device cannot hold what a peer offers (checked before the first byte moves)."""

    def __init__(self, device: str, needed: int, free: int):
        from weightcache.core.progress import format_bytes

        self.device = device
        self.needed = needed
        self.free = free
        super().__init__(
            f"the entry needs {format_bytes(needed)} on {device}, which has {format_bytes(free)} free; nothing was allocated. "
            "Free memory there (evict entries, stop an engine) or receive on another device"
        )


class HandoverFailed(WeightCacheError):
    """A successor could not take a running server's entries over; the running server keeps serving every entry."""


class FleetUnavailable(WeightCacheError):
    """The fleet's registry (etcd) did not answer within its deadline (``kind`` ``unreachable``), refused a
    certificate either way (``certificate``) or refused the user or password (``auth``). A load then reads the disk
    and says so itself."""

    def __init__(self, endpoints: "typing.Sequence[str]", reason: str, kind: str = "unreachable"):
        self.endpoints = tuple(endpoints)
        self.reason = reason
        self.kind = kind
        at = f"the fleet registry at {', '.join(self.endpoints)}"
        if kind == "certificate":
            text = (
                f"{at}: TLS failed, a certificate was refused ({reason}). Check WEIGHTCACHE_FLEET_ETCD_CA (the CA that "
                "signed etcd's certificate) and WEIGHTCACHE_FLEET_ETCD_CERT/_KEY (a client certificate etcd's "
                "--trusted-ca-file signed)"
            )
        elif kind == "auth":
            text = (
                f"{at} refused the user or password ({reason}). Check WEIGHTCACHE_FLEET_ETCD_USER and its password "
                "(WEIGHTCACHE_FLEET_ETCD_PASSWORD_FILE), and that the user's role may read and write the fleet's prefix"
            )
        else:
            text = (
                f"{at} did not answer ({reason}). Check that etcd runs there (`etcdctl endpoint health`) or unset "
                "WEIGHTCACHE_FLEET_ETCD"
            )
        super().__init__(text)


class PullFailed(WeightCacheError):
    """Pulling an entry from another node broke off or brought other bytes; nothing was published from it."""

    def __init__(self, node: str, reason: str):
        self.node = node
        self.reason = reason
        super().__init__(f"pulling from node {node} failed: {reason}; nothing from it was published")


class VersionNotFound(WeightCacheError):
    """The server holds no such version of the model an engine maps (refit); nothing was switched."""

    def __init__(self, lineage: str, version: int | None, held: "typing.Sequence[int]"):
        self.lineage = lineage
        self.version = version
        self.held = tuple(held)
        if not self.held:
            super().__init__(
                f"the server holds no version of model {lineage[:12]}: publish the model from disk first (`weightcache load` "
                "with the same options), then its versions"
            )
            return
        super().__init__(
            f"the server holds no version {version} of model {lineage[:12]} (it holds {list(self.held)}); nothing was "
            "switched: publish it first (`publish_version`), or ask for one it holds"
        )


class LayoutMismatch(WeightCacheError, ValueError):
    """A new version's tensors are not laid out as its model's (``difference`` names the first); nothing changed."""

    def __init__(self, what: str, difference: str):
        self.what = what
        self.difference = difference
        super().__init__(
            f"{what} differs in layout from the model's: {difference}; nothing was published or switched. A version keeps "
            "every name, shape and dtype of its model: give the tensors those, or publish a new model with `weightcache load`"
        )


PUBLIC_MODULE = "weightcache.errors"
"""Where every public error is imported from: its ``__module__``, so a traceback names ``weightcache.errors.X`` (where
a user finds it), not this private module. Pickling looks the class up there and finds the same class."""


def _publish(*classes: type) -> None:
    for cls in classes:
        cls.__module__ = PUBLIC_MODULE


_publish(
    WeightCacheError, ProtocolError, ServerUnavailable, AccessDenied, ServerError, EntryNotFound, FingerprintMismatch,
    EntryCorrupt, ChecksumMismatch, EntryUnusable, CheckpointChanged, CheckpointNotFound, ModelNotCached,
    InvalidCheckpoint, InvalidManifest, UnsupportedQuantization, AdapterNotFound, InvalidAdapter, UnknownOption,
    InvalidOption, RebindError, ArenaError, BackendUnavailable, CudaError, DeviceNotFound, DeviceUnavailable, NoRoom,
    NoMemory, StandbyError, CompileArtifactsUnavailable, SeedRefused, SeedFailed, VersionNotFound, LayoutMismatch,
    NotRegularFile, FleetUnavailable, PullFailed,
)  # fmt: skip
