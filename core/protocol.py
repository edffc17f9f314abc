"""The wire format: length-prefixed JSON frames over a Unix socket, fds as SCM_RIGHTS.

A frame is a 12-byte header ``!4sHHI`` (magic ``WCF1``, protocol version,
number of fds, payload length) followed by a UTF-8 JSON object. The fds
travel as SCM_RIGHTS ancillary data on the frame's bytes, at most
``FDS_PER_MESSAGE`` per sendmsg, so one frame may carry thousands of arenas.
No pickle: a frame is data, never code.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time

from weightcache.core import PROTOCOL_VERSION
from weightcache.core.errors import ProtocolError

MAGIC = b"WCF1"
HEADER = struct.Struct("!4sHHI")
MAX_FRAME_BYTES = 64 << 20
MAX_FDS = 4096
FDS_PER_MESSAGE = 250
FRAME_DEADLINE_S = 10.0
_CMSG_SPACE = socket.CMSG_SPACE(FDS_PER_MESSAGE * 4)


def encode(message: dict) -> bytes:
    """The JSON payload of ``message`` (a dict)."""
    if not isinstance(message, dict):
        raise TypeError("a frame's message must be a dict")
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode()


def send_frame(sock: socket.socket, message: dict, fds=(), version: int = PROTOCOL_VERSION) -> None:
    """Send ``message`` and ``fds`` as one frame (the fds stay open on this side)."""
    fds = list(fds)
    payload = encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"frame carries {len(fds)} fds; the limit is {MAX_FDS}")
    data = HEADER.pack(MAGIC, version, len(fds), len(payload)) + payload
    batches = [fds[i : i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)]
    if len(batches) > len(data):
        # Each batch rides on at least one byte of the frame; a zero-byte sendmsg drops its fds.
        raise ProtocolError(f"a frame of {len(data)} bytes cannot carry {len(fds)} fds ({len(batches)} messages)")
    # One byte per fd batch, the rest of the frame after the last batch.
    for index, batch in enumerate(batches[:-1]):
        _sendmsg_all(sock, data[index : index + 1], batch)
    start = max(len(batches) - 1, 0)
    _sendmsg_all(sock, data[start:], batches[-1] if batches else [])


def _sendmsg_all(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


class FrameReader:
    """Reads frames from one socket; every fd received is closed if the frame is bad."""

    def __init__(self, sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, deadline_s: float = FRAME_DEADLINE_S):
        self.sock = sock
        self.max_bytes = max_bytes
        self.deadline_s = deadline_s

    def read(self, idle_timeout: float | None = None) -> tuple[dict, list[int]] | None:
        """The next ``(message, fds)``, or None when the peer closed between frames.

        Waits up to ``idle_timeout`` (None: forever) for the frame to start, then
        at most ``deadline_s`` for the whole frame. Raises ProtocolError on a
        malformed frame and TimeoutError when a deadline passes.
        """
        fds: list[int] = []
        try:
            first = self._recv(1, fds, idle_timeout, allow_eof=True)
            if first is None:
                return None
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
            payload = self._recv_exact(length, fds, deadline)
            if len(fds) != nfds:
                raise ProtocolError(f"frame declared {nfds} fds but carried {len(fds)}")
            message = _decode(payload)
            return message, fds
        except BaseException:
            close_fds(fds)
            raise

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

    def _recv(self, size: int, fds: list[int], timeout: float | None, allow_eof: bool) -> bytes | None:
        self.sock.settimeout(timeout)
        try:
            data, ancdata, flags, _ = self.sock.recvmsg(size, _CMSG_SPACE)
        except socket.timeout:
            if allow_eof:
                raise TimeoutError("no frame arrived in time") from None
            raise TimeoutError(f"frame not complete within {self.deadline_s:.1f} s") from None
        for level, kind, blob in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(blob[: len(blob) - len(blob) % received.itemsize])
                fds.extend(received)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("too many fds in one message; ancillary data was truncated")
        if not data:
            if allow_eof and not fds:
                return None
            raise ProtocolError("connection closed in the middle of a frame")
        return data


def _decode(payload: bytes) -> dict:
    try:
        message = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"frame payload is not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("frame payload nests JSON too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame payload must be a JSON object")
    return message


def close_fds(fds) -> None:
    """Close every fd in ``fds``, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def error_reply(code: str, message: str, **details) -> dict:
    """A reply that refuses a request."""
    return {"ok": False, "error": {"code": code, "message": message, **details}}


def ok_reply(**fields) -> dict:
    """A reply that answers a request."""
    return {"ok": True, **fields}
