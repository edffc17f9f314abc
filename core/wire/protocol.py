"""The wire format: length-prefixed JSON frames over a Unix socket, fds as SCM_RIGHTS.

A frame is a 12-byte header ``!4sHHI`` (magic ``WCF1``, protocol version,
number of fds, payload length) followed by a UTF-8 JSON object. The fds
travel as SCM_RIGHTS ancillary data on the frame's bytes, at most
``FDS_PER_MESSAGE`` per sendmsg, so one frame may carry thousands of arenas:
the first batch with the header, each further batch on one payload byte.
No pickle: a frame is data, never code.

A reader never holds more fds than a frame may carry: at most one batch
before the header says how many are coming, never more than it said after.
A server also caps what all its unfinished frames hold together (``InFlight``).
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
import time
import typing
from collections.abc import Iterable

from weightcache.core import PROTOCOL_VERSION
from weightcache.core.errors import FrameRefused, IdleTimeout, ProtocolError

MAGIC = b"WCF1"
HEADER = struct.Struct("!4sHHI")
MAX_FRAME_BYTES = 64 << 20
MAX_FDS = 4096
FDS_PER_MESSAGE = 250
FRAME_DEADLINE_S = 10.0
MAX_SOURCES = 16
"""Most rows of a ``locate`` reply (a node has a few GPUs and one host tier): the server names no more, a client reads no more."""
_CMSG_SPACE = socket.CMSG_SPACE(FDS_PER_MESSAGE * 4)


def encode(message: dict) -> bytes:
    """The JSON payload of ``message`` (a dict)."""
    if not isinstance(message, dict):
        raise TypeError("a frame's message must be a dict")
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode()


def send_frame(sock: socket.socket, message: dict, fds: Iterable[int] = (), version: int = PROTOCOL_VERSION) -> None:
    """Send ``message`` and ``fds`` as one frame (the fds stay open on this side).

    The first batch of fds rides on the header, each further batch on one
    payload byte, the last one on the rest of the frame: a reader thus never
    holds more than one batch before it knows how many fds the frame declares.
    """
    fds = list(fds)
    payload = encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"frame carries {len(fds)} fds; the limit is {MAX_FDS}")
    data = HEADER.pack(MAGIC, version, len(fds), len(payload)) + payload
    batches = [fds[i : i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)] or [[]]
    if len(batches) > len(payload) + 1:
        # Each batch after the first rides on at least one payload byte; a zero-byte sendmsg drops its fds.
        raise ProtocolError(f"a frame of {len(data)} bytes cannot carry {len(fds)} fds ({len(batches)} messages)")
    cuts = [0] + [HEADER.size + i for i in range(len(batches) - 1)] + [len(data)]
    for batch, start, end in zip(batches, cuts, cuts[1:], strict=False):
        _sendmsg_all(sock, data[start:end], batch)


def _sendmsg_all(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


class InFlight:
    """What every unfinished frame of a server holds together: received fds and reserved payload bytes, each capped.

    A frame whose fds would pass ``max_fds`` is refused at once; one whose
    payload would pass ``max_bytes`` waits up to ``wait_s`` for others to
    finish, then is refused (both with FrameRefused, code ``busy``).
    """

    def __init__(self, max_fds: int, max_bytes: int, wait_s: float = 1.0):
        self.max_fds = max_fds
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        self.fds = 0
        self.bytes = 0
        self._changed = threading.Condition()

    def take_fds(self, count: int) -> None:
        with self._changed:
            if self.fds + count > self.max_fds:
                raise FrameRefused(
                    f"unfinished frames already hold {self.fds} fds and the server takes at most {self.max_fds} at once; "
                    "try again shortly"
                )
            self.fds += count

    def take_bytes(self, count: int, deadline: float) -> None:
        """Reserve ``count`` payload bytes, waiting up to ``wait_s`` (and never past ``deadline``) for room."""
        if count > self.max_bytes:
            raise FrameRefused(f"a frame of {count} bytes exceeds the {self.max_bytes} bytes the server reads at once")
        wait_until = min(time.monotonic() + self.wait_s, deadline)
        with self._changed:
            while self.bytes + count > self.max_bytes:
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    raise FrameRefused(
                        f"unfinished frames hold {self.bytes} of the {self.max_bytes} bytes the server reads at once; "
                        f"a frame of {count} bytes did not fit within {self.wait_s:.1f} s; try again shortly"
                    )
                self._changed.wait(remaining)
            self.bytes += count

    def release(self, fds: int = 0, nbytes: int = 0) -> None:
        with self._changed:
            self.fds -= fds
            self.bytes -= nbytes
            self._changed.notify_all()


class FrameReader:
    """Reads frames from one socket; every fd received is closed if the frame is bad.

    :param in_flight: the server-wide ledger this reader's unfinished frame counts against (None: no cap).
    """

    def __init__(
        self,
        sock: socket.socket,
        max_bytes: int = MAX_FRAME_BYTES,
        deadline_s: float = FRAME_DEADLINE_S,
        in_flight: InFlight | None = None,
    ):
        self.sock = sock
        self.max_bytes = max_bytes
        self.deadline_s = deadline_s
        self.in_flight = in_flight
        self.busy = False  # from a frame's first byte until the next read() (the caller is answering it)
        self._declared: int | None = None
        self._held_fds = 0

    def read(self, idle_timeout: float | None = None) -> tuple[dict, list[int]] | None:
        """The next ``(message, fds)``, or None when the peer closed between frames.

        Waits up to ``idle_timeout`` (None: forever) for the frame to start
        (IdleTimeout after that), then at most ``deadline_s`` for the whole
        frame (TimeoutError). Raises ProtocolError on a malformed frame and
        FrameRefused when the in-flight ledger has no room for it.
        """
        fds: list[int] = []
        held_bytes = 0
        self._declared = None
        self._held_fds = 0
        self.busy = False
        try:
            first = self._recv(1, fds, idle_timeout, allow_eof=True)
            if not first:  # the peer closed between frames
                return None
            self.busy = True
            deadline = time.monotonic() + self.deadline_s
            header = first + self._recv_exact(HEADER.size - 1, fds, deadline)
            magic, version, nfds, length = HEADER.unpack(header)
            if magic != MAGIC:
                raise ProtocolError(f"bad magic {magic!r}: the peer does not speak the weightcache protocol")
            if version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION}); "
                    "run the same weightcache version on the server and the engines"
                )
            if length > self.max_bytes:
                raise ProtocolError(f"frame of {length} bytes exceeds the {self.max_bytes}-byte limit")
            if nfds > MAX_FDS:
                raise ProtocolError(f"frame declares {nfds} fds; the limit is {MAX_FDS}")
            self._declared = nfds
            self._check_fd_count(fds)
            if self.in_flight is not None:
                self.in_flight.take_bytes(length, deadline)
                held_bytes = length
            payload = self._recv_exact(length, fds, deadline)
            if len(fds) != nfds:
                raise ProtocolError(f"frame declared {nfds} fds but carried {len(fds)}")
            message = decode(payload)
            return message, fds
        except BaseException:
            self.busy = False
            close_fds(fds)
            raise
        finally:
            if self.in_flight is not None:
                self.in_flight.release(fds=self._held_fds, nbytes=held_bytes)
            self._held_fds = 0

    def _check_fd_count(self, fds: list[int]) -> None:
        if self._declared is None:
            if len(fds) > FDS_PER_MESSAGE:
                raise ProtocolError(
                    f"{len(fds)} fds arrived before the frame's header was complete; at most {FDS_PER_MESSAGE} may come with it"
                )
        elif len(fds) > self._declared:
            raise ProtocolError(f"frame declared {self._declared} fds but carried {len(fds)}")

    def _recv_exact(self, size: int, fds: list[int], deadline: float) -> bytes:
        chunks, remaining = [], size
        while remaining:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError(f"frame not complete within {self.deadline_s:.1f} s")
            chunk = self._recv(min(remaining, 1 << 20), fds, timeout, allow_eof=False)
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def _recv(self, size: int, fds: list[int], timeout: float | None, allow_eof: bool) -> bytes:
        """At most ``size`` bytes and the fds that came with them; ``b""`` only where ``allow_eof`` (between frames)."""
        self.sock.settimeout(timeout)
        try:
            data, ancdata, flags, _ = self.sock.recvmsg(size, _CMSG_SPACE)
        except TimeoutError:
            if allow_eof:
                raise IdleTimeout("no frame arrived in time") from None
            raise TimeoutError(f"frame not complete within {self.deadline_s:.1f} s") from None
        received = array.array("i")
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received.frombytes(blob[: len(blob) - len(blob) % received.itemsize])
        fds.extend(received)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("too many fds in one message; ancillary data was truncated")
        if received:
            self._check_fd_count(fds)
            if self.in_flight is not None:
                self.in_flight.take_fds(len(received))
                self._held_fds += len(received)
        if not data:
            if allow_eof and not fds:
                return b""
            raise ProtocolError("connection closed in the middle of a frame")
        return data


def decode(payload: bytes) -> dict:
    """A frame's JSON payload as a dict; ProtocolError for anything else."""
    try:
        message = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame payload is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("frame payload nests JSON too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame payload must be a JSON object")
    return message


_decode = decode  # its name before the launcher read frames of its own


def close_fds(fds: Iterable[int]) -> None:
    """Close every fd in ``fds``, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def error_reply(code: str, message: str, **details: typing.Any) -> dict:
    """A reply that refuses a request."""
    return {"ok": False, "error": {"code": code, "message": message, **details}}


def ok_reply(**fields: typing.Any) -> dict:
    """A reply that answers a request."""
    return {"ok": True, **fields}
