"""A launcher's callers' connections while their request arrives: read without blocking, each with its own deadline.

The launcher is one thread (it forks), so it never waits on one caller: a connection is read as its bytes arrive,
beside every other, and one that has not sent its whole request within ``REQUEST_DEADLINE_S`` of its accept is
closed. An idle or slow connection thus delays nobody else's launch, and at most ``MAX_PENDING`` wait at once (the
oldest is dropped for a new one).
"""

from __future__ import annotations

import array
import logging
import socket
import time

import attrs

from weightcache.core import PROTOCOL_VERSION
from weightcache.core.errors import ProtocolError
from weightcache.core.wire.protocol import FDS_PER_MESSAGE, HEADER, MAGIC, MAX_FDS, close_fds, decode

log = logging.getLogger(__name__)

REQUEST_DEADLINE_S = 10.0
"""How long a caller has, from its accept, to send its whole request."""
MAX_REQUEST_BYTES = 16 << 20
"""The largest request a launcher reads: a command line and an environment (Linux passes at most a few MiB to exec)."""
MAX_PENDING = 64
"""The most connections whose request is still arriving; beyond it the oldest is dropped."""
_CMSG_SPACE = socket.CMSG_SPACE(FDS_PER_MESSAGE * 4)


@attrs.define(eq=False)
class Pending:
    """One caller's connection whose request has not all arrived: what came so far, and until when it may come."""

    conn: socket.socket
    pid: int
    deadline: float
    data: bytearray = attrs.field(factory=bytearray)
    fds: list[int] = attrs.field(factory=list)

    @classmethod
    def accepted(cls, conn: socket.socket, pid: int) -> Pending:
        conn.setblocking(False)
        return cls(conn, pid, time.monotonic() + REQUEST_DEADLINE_S)

    def read(self) -> tuple[dict, list[int]] | None:
        """What has arrived: the request and its fds once complete (the fds are the caller's then), else None.
        ProtocolError for a malformed frame, EOFError when the caller closed first (empty-handed: quietly)."""
        while True:
            try:
                data, ancdata, flags, _ = self.conn.recvmsg(1 << 16, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                return self._complete()
            for level, kind, blob in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(blob[: len(blob) - len(blob) % received.itemsize])
                    self.fds.extend(received)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("too many fds in one message; ancillary data was truncated")
            if not data:
                if not self.data and not self.fds:
                    raise EOFError
                raise ProtocolError("the caller closed the connection in the middle of its request")
            self.data += data
            self._check()

    def _declared(self) -> tuple[int, int] | None:
        """The frame's fd count and payload length, once its header is here (checked)."""
        if len(self.data) < HEADER.size:
            return None
        magic, version, nfds, length = HEADER.unpack_from(self.data)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}: the peer does not speak the weightcache protocol")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} is not this launcher's ({PROTOCOL_VERSION}); run one version")
        if length > MAX_REQUEST_BYTES or nfds > MAX_FDS:
            raise ProtocolError(f"a request of {length} bytes and {nfds} fds exceeds what a launcher reads")
        return nfds, length

    def _check(self) -> None:
        declared = self._declared()
        nfds, length = declared if declared is not None else (FDS_PER_MESSAGE, MAX_REQUEST_BYTES)
        if len(self.fds) > nfds:
            raise ProtocolError(f"the request carried more fds than the {nfds} it declared")
        if len(self.data) > HEADER.size + length:
            raise ProtocolError("the caller sent more than one request")

    def _complete(self) -> tuple[dict, list[int]] | None:
        declared = self._declared()
        if declared is None or len(self.data) < HEADER.size + declared[1]:
            return None
        if len(self.fds) != declared[0]:
            raise ProtocolError(f"the request declared {declared[0]} fds but carried {len(self.fds)}")
        message = decode(bytes(self.data[HEADER.size :]))
        fds, self.fds = self.fds, []
        self.conn.setblocking(True)
        return message, fds

    def close(self) -> None:
        close_fds(self.fds)
        self.fds = []
        self.conn.close()
