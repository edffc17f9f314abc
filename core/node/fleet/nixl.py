"""The NIXL transport: memory registered with a NIXL agent (UCX backend), read by peers with one-sided reads.

The holder's agent only registers memory; a peer reads it with no code of the holder
running (UCX's progress thread answers). A peer connects with the holder agent's
metadata (its UCX worker address and memory keys), which the registry carries as the
``reach`` text. NIXL authenticates nobody: whoever has the metadata and reaches the
address can read what is registered (docs/operations.md, "A fleet").
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import importlib
import logging
import os
import sys
import time
import typing

import attrs

from weightcache.core.errors import BackendUnavailable, PullFailed
from weightcache.core.node.fleet.transport import Region, Transport

log = logging.getLogger(__name__)

MODULES: typing.Final = ("nixl", "nixl_cu13", "nixl_cu12")
"""Import names of NIXL's Python API, by the PyPI package that ships it (``nixl``, ``nixl-cu13``, ``nixl-cu12``)."""
POLL_S: typing.Final = 0.0005
"""The first wait between two looks at a read's state; each next wait is half as long again, up to ``POLL_MAX_S``
(a long read is not looked at thousands of times a second; a short one is seen done within half its time)."""
POLL_MAX_S: typing.Final = 0.01
WINDOW: typing.Final = 2
"""Reads of one region's pieces in flight at once on a fast wire: enough to keep it busy between two, few enough that
they land in order (with many in flight UCX's TCP interleaves them, and all land together at the end)."""
SLOW_PIECE_S: typing.Final = 0.01
"""A piece that held the wire longer than this (1 MiB slower than 100 MB/s) marks a slow wire, where one piece is in
flight at a time: two interleave over UCX's TCP and land together, so the node behind a relay would see the relay's
bytes two pieces at a time, a hop's lag; the next read's round trip is small beside such a piece (decision 85)."""
LOOKS_PER_PIECE: typing.Final = 50
"""On a slow wire a read is looked at about this often during a piece's time (at most every ``POLL_MAX_S``): one piece
in flight leaves the wire idle from its landing until it is seen."""


@attrs.frozen
class _Flying:
    """A piece's read in flight: where the region has landed up to once it is done, NIXL's handle, when it was posted."""

    end: int
    handle: typing.Any
    posted_at: float


@attrs.define
class _Pace:
    """How long the last piece held the wire, and what follows: how many pieces to keep in flight, how often to look."""

    wire_free_at: float
    """When the wire finished the last piece (at first: when the read began)."""
    piece_s: float | None = None

    def landed(self, posted_at: float, now: float) -> None:
        self.piece_s = now - max(posted_at, self.wire_free_at)  # (a piece posted early waited for the one before)
        self.wire_free_at = now

    def in_flight(self) -> int:
        return 1 if self.piece_s is not None and self.piece_s > SLOW_PIECE_S else WINDOW

    def look_every(self) -> float:
        if self.piece_s is None:
            return POLL_MAX_S
        return max(POLL_S, min(POLL_MAX_S, self.piece_s / LOOKS_PER_PIECE))


def nixl_api() -> typing.Any:
    """NIXL's Python module; BackendUnavailable naming the package to install when none imports."""
    problems = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
        problems.append(f"{name}: has no nixl_agent")
    raise BackendUnavailable(
        "nixl", f"NIXL is not installed ({'; '.join(problems)}); pip install 'weightcache[fleet]' (nixl-cu13, UCX bundled)"
    )


def rdma_devices() -> tuple[str, ...]:
    """This machine's RDMA devices (InfiniBand, RoCE: ``/sys/class/infiniband``), over which UCX reads GPU memory
    directly (GPUDirect RDMA); none: UCX moves GPU memory over TCP through host buffers."""
    try:
        return tuple(sorted(os.listdir("/sys/class/infiniband")))
    except OSError:
        return ()


def gpu_direct_possible(devices: str, rdma: typing.Sequence[str]) -> bool:
    """Whether UCX on ``devices`` (its comma-separated list, ``mlx5_0:1`` for a port of an RDMA device; empty: its
    choice) can read GPU memory without host staging: only over an RDMA device. Over TCP alone UCX still registers VRAM
    but reads it through ``cuda_copy`` and host buffers (docs/benchmarks.md, the fleet), so kinds alone do not say
    GPU-direct."""
    if not devices:
        return bool(rdma)
    return any(name.strip().split(":")[0] in rdma for name in devices.split(","))


def path_of(remote: Region, local: Region, gpu_direct: bool = False) -> str:
    """How a read from ``remote`` into ``local`` goes, for the output (``gpu_direct``: over an RDMA device)."""
    if remote.memory == "VRAM" and local.memory == "VRAM":
        if gpu_direct:
            return "GPU-direct (NIXL/UCX over RDMA, GPU memory to GPU memory)"
        return "GPU memory to GPU memory through host buffers (NIXL/UCX over TCP: no RDMA device)"
    if local.memory == "VRAM":
        return "host memory to GPU (NIXL/UCX)"
    if remote.memory == "VRAM":
        return "GPU memory to host memory (NIXL/UCX)"
    return "host memory to host memory (NIXL/UCX)"


WAKE_US: typing.Final = 5000
"""The longest UCX's progress thread sleeps when no event wakes it (it polls its workers' event fds, NIXL's UCX
backend with ``pthrDelay``). NIXL's Python API asks for 0, a thread that never sleeps: an idle agent took a third of
a core here, and a fleet on one machine runs one per server's agent and per puller (docs/decisions.md 91)."""


def _agent_that_sleeps(api: typing.Any, agent_name: str) -> typing.Any:
    """``api.nixl_agent(agent_name)`` with no backend yet, its progress thread woken by events or after ``WAKE_US``.

    The Python API fixes the delay at 0, so the agent it made is replaced by one from NIXL's bindings with the same
    settings but the delay. Where a NIXL lacks what this needs, the agent is kept as made (its thread spins; one line
    at debug level says so).
    """
    agent = api.nixl_agent(agent_name, api.nixl_agent_config(backends=[]))
    module = sys.modules.get(type(agent).__module__)
    bindings: typing.Any = getattr(module, "nixlBind", None)
    sync: typing.Any = getattr(module, "nixl_thread_sync_t", None)
    try:
        config = bindings.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False
        config.syncMode = sync.NIXL_THREAD_SYNC_NONE.value
        config.pthrDelay = WAKE_US
        config.lthrDelay = 100_000
        config.captureTelemetry = False
        agent.agent = bindings.nixlAgent(agent_name, config)
    except Exception as exc:  # a NIXL without these names, or whose bindings refuse them: the agent as made
        log.debug("weightcache: NIXL's progress thread keeps its delay of 0 (%s: %s)", type(exc).__name__, exc)
    return agent


class NixlTransport(Transport):
    """A NIXL agent of this process, named ``agent_name`` (unique in the fleet), with the UCX backend."""

    name = "nixl"

    def __init__(self, agent_name: str, devices: str = ""):
        api = nixl_api()
        try:
            self.agent = _agent_that_sleeps(api, agent_name)
            self.agent.create_backend("UCX", {"ucx_devices": devices} if devices else {})
        except Exception as exc:  # NIXL raises its bindings' own types
            raise BackendUnavailable("nixl", f"a NIXL agent with UCX could not start: {exc}") from None
        if "UCX" not in self.agent.backends:
            raise BackendUnavailable("nixl", "NIXL's UCX plugin did not load; reinstall nixl-cu13 (it bundles UCX)")
        self.agent_name = agent_name
        self.gpu_direct = gpu_direct_possible(devices, rdma_devices())
        self._shared: dict[Region, typing.Any] = {}
        self._peer: tuple[str, typing.Any, str] | None = None
        """The peer last read from: its reach text, NIXL's handle and its name."""
        self._pace = _Pace(wire_free_at=0.0)
        """How fast the last pieces came (carried over from read to read: a relay's reach changes with each arena it
        lists; the first piece from a faster node sets it again)."""

    def share(self, regions: typing.Sequence[Region]) -> str:
        for region in regions:
            if region not in self._shared:
                self._shared[region] = self._register(region)
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def unshare(self, regions: typing.Sequence[Region]) -> None:
        for region in regions:
            descs = self._shared.pop(region, None)
            if descs is not None:
                self.agent.deregister_memory(descs)

    def _covered(self, region: Region) -> bool:
        """Whether ``region`` lies within memory this agent has registered."""
        return any(
            shared.memory == region.memory
            and shared.device == region.device
            and shared.address <= region.address
            and region.address + region.length <= shared.address + shared.length
            for shared in self._shared
        )

    def _register(self, region: Region) -> typing.Any:
        return self.agent.register_memory([(region.address, region.length, region.device, "")], region.memory)

    def read(self, reach: str, remote: typing.Sequence[Region], local: typing.Sequence[Region], deadline_s: float) -> str:
        with self._connected(reach, local) as (peer, peer_name):
            for source, target in zip(remote, local, strict=True):
                handle = self._post(peer, peer_name, source, target)
                try:
                    self._wait(peer_name, handle, time.monotonic() + deadline_s)
                finally:
                    self._release([handle])
        return path_of(remote[0], local[0], self.gpu_direct) if remote else "nothing to read"

    def read_in_pieces(
        self,
        reach: str,
        remote: Region,
        local: Region,
        piece_bytes: int,
        deadline_s: float,
        landed: typing.Callable[[int], None],
        available: typing.Callable[[], int] | None = None,
    ) -> str:
        """Up to ``WINDOW`` pieces in flight at once (the next one queued on the wire while one lands), one on a slow
        wire (``SLOW_PIECE_S``), landed in order; with ``available``, each next piece is posted as soon as the peer has
        it (and the deadline counts from it)."""
        if remote.length != local.length:
            raise PullFailed("?", f"a remote region of {remote.length} bytes cannot fill a local one of {local.length}")
        with self._connected(reach, [local]) as (peer, peer_name):
            deadline = time.monotonic() + deadline_s
            flying: list[_Flying] = []
            pace = self._pace
            pace.wire_free_at = time.monotonic()  # (the wire idled between two calls)
            start = 0
            try:
                while start < remote.length or flying:
                    limit = remote.length if available is None else min(available(), remote.length)
                    if start < limit and len(flying) < pace.in_flight():
                        end = min(start + piece_bytes, limit)
                        part = (remote.part(start, end - start), local.part(start, end - start))
                        flying.append(_Flying(end, self._post(peer, peer_name, *part), time.monotonic()))
                        start = end
                        if available is not None:
                            deadline = time.monotonic() + deadline_s
                    elif flying:
                        self._land_first(peer_name, flying, deadline, pace, landed)
                    else:
                        break  # (nothing more there yet: the caller waits for the peer, then reads on)
            finally:
                self._release([piece.handle for piece in flying])
        return path_of(remote, local, self.gpu_direct)

    def _land_first(
        self, peer_name: str, flying: list[_Flying], deadline: float, pace: _Pace, landed: typing.Callable[[int], None]
    ) -> None:
        """Wait for the oldest read in flight, release it and say how far the region has landed."""
        piece = flying[0]
        self._wait(peer_name, piece.handle, deadline, pace.look_every())  # (a failure: the caller releases them all)
        pace.landed(piece.posted_at, time.monotonic())
        flying.pop(0)
        self._release([piece.handle])
        landed(piece.end)

    @contextlib.contextmanager
    def _connected(self, reach: str, local: typing.Sequence[Region]) -> typing.Iterator[tuple[typing.Any, str]]:
        """The peer at ``reach`` and ``local`` registered, for the time of a read. The peer stays added for the next
        read with the same ``reach`` (its memory as it was: a peer that registers more sends another); a read that
        fails forgets it."""
        peer, peer_name = self._peer_at(reach)
        registered = []
        try:
            for region in local:
                if not self._covered(region):  # (a relay's landing buffer is registered already)
                    registered.append(self._register(region))
            yield peer, peer_name
        except BaseException:
            self._forget_peer()
            raise
        finally:
            for descs in registered:
                self.agent.deregister_memory(descs)

    def _peer_at(self, reach: str) -> tuple[typing.Any, str]:
        if self._peer is not None and self._peer[0] == reach:
            return self._peer[1], self._peer[2]
        self._forget_peer()
        try:
            metadata = base64.b64decode(reach, validate=True)
        except (binascii.Error, ValueError):
            raise PullFailed("?", "its reach text is not base64 NIXL metadata") from None
        try:
            peer = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise PullFailed("?", f"NIXL refused its metadata ({exc})") from None
        peer_name = peer.decode(errors="replace") if isinstance(peer, bytes) else str(peer)
        self._peer = (reach, peer, peer_name)
        return peer, peer_name

    def _forget_peer(self) -> None:
        if self._peer is None:
            return
        _, peer, peer_name = self._peer
        self._peer = None
        try:
            self.agent.remove_remote_agent(peer)
        except Exception as exc:  # a peer that vanished may take its entry with it
            log.debug("weightcache: forgetting NIXL peer %s: %s", peer_name, exc)

    def _post(self, peer: typing.Any, peer_name: str, source: Region, target: Region) -> typing.Any:
        """Start reading ``source`` of the peer into ``target``; the transfer's handle."""
        if source.length != target.length:
            raise PullFailed(peer_name, f"a remote region of {source.length} bytes cannot fill a local one of {target.length}")
        try:
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs([(target.address, target.length, target.device)], target.memory),
                self.agent.get_xfer_descs([(source.address, source.length, source.device)], source.memory),
                peer,
            )
        except Exception as exc:
            raise PullFailed(peer_name, f"NIXL could not prepare the read ({exc})") from None
        try:
            state = self._state(peer_name, lambda: self.agent.transfer(handle))
        except BaseException:
            self._release([handle])
            raise
        if state not in ("PROC", "DONE"):
            self._release([handle])
            raise PullFailed(peer_name, f"the read ended in state {state} (the peer went away or refused)")
        return handle

    def _wait(self, peer_name: str, handle: typing.Any, deadline: float, longest_wait: float = POLL_MAX_S) -> None:
        """Wait until the transfer of ``handle`` is done (PullFailed past ``deadline``, or when it fails), looking at
        it at most ``longest_wait`` apart."""
        wait = POLL_S
        state = self._state(peer_name, lambda: self.agent.check_xfer_state(handle))
        while state == "PROC":
            if time.monotonic() > deadline:
                raise PullFailed(peer_name, "the read did not finish before its deadline")
            time.sleep(wait)
            wait = min(wait * 1.5, longest_wait)
            state = self._state(peer_name, lambda: self.agent.check_xfer_state(handle))
        if state != "DONE":
            raise PullFailed(peer_name, f"the read ended in state {state} (the peer went away or refused)")

    def _release(self, handles: typing.Sequence[typing.Any]) -> None:
        for handle in handles:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:  # a handle of a failed read may refuse to go; NIXL frees it with the agent
                log.debug("weightcache: releasing a NIXL transfer: %s", exc)

    @staticmethod
    def _state(peer_name: str, ask: typing.Callable[[], str]) -> str:
        """A transfer's state; PullFailed when NIXL raises (``NIXL_ERR_REMOTE_DISCONNECT``: the peer died)."""
        try:
            return ask()
        except Exception as exc:  # NIXL's bindings raise their own types
            raise PullFailed(peer_name, f"the read broke off ({type(exc).__name__}: {exc})") from None

    def memory_kinds(self) -> frozenset[str]:
        kinds = (kind.removesuffix("_SEG") for kind in self.agent.get_backend_mem_types("UCX"))
        return frozenset(kinds) & {"DRAM", "VRAM"}

    def close(self) -> None:
        """Unregister everything and drop the agent: its UCX worker and progress thread go with it, so a read that
        outlived its deadline writes nothing more into memory that its caller then frees."""
        self._forget_peer()
        self.unshare(list(self._shared))
        self.agent = None
