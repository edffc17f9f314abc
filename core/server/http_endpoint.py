"""The server's HTTP listener (``--metrics-port``): a few GET routes that no client can starve.

One thread runs one selector loop over the listening socket and at most ``max_connections`` connections;
nothing else runs per connection. A request must arrive whole (headers, at most ``MAX_REQUEST_BYTES``) and
its answer leave within ``deadline_s`` of the connection's accept, or the connection is closed. A newcomer
when every slot is taken displaces the oldest connection: a client that opens connections and sends half a
request holds a slot for at most ``deadline_s`` and never keeps a scrape or a probe out. Answers are
HTTP/1.0 with ``Connection: close`` (Prometheus and Kubernetes probes need nothing more).

Binding is separate (``bind``), so the server binds every listener, and hands them over on a restart, before
it announces readiness.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
import typing
from collections.abc import Callable

import attrs

from weightcache.core.errors import ListenerUnavailable

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
"""Connections served at once; a newcomer beyond it displaces the oldest."""
DEADLINE_S = 5.0
"""How long a connection may take, from its accept, to send its request and take the answer."""
MAX_REQUEST_BYTES = 8192
"""Largest request head (request line and headers) read; a longer one is answered 431."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large"}
_REASONS |= {500: "Internal Server Error", 503: "Service Unavailable"}
_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@attrs.frozen
class Response:
    """An answer: status, body and its content type."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def text(cls, status: int, text: str) -> Response:
        return cls(status, (text.rstrip("\n") + "\n").encode())

    def encode(self, head_only: bool) -> bytes:
        head = (
            f"HTTP/1.0 {self.status} {_REASONS.get(self.status, 'Unknown')}\r\nContent-Type: {self.content_type}\r\n"
            f"Content-Length: {len(self.body)}\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n"
        )
        return head.encode() + (b"" if head_only else self.body)


Route = Callable[[], Response]


def bind(host: str, port: int, what: str = "--metrics-port") -> socket.socket:
    """A TCP socket listening on ``host``:``port`` (0: any free port); ListenerUnavailable, with nothing left open, if
    the name does not resolve or the address cannot be bound."""
    family, kind, proto, address = resolve(host, port, what)
    sock = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server binds past TIME_WAIT
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        hint = {
            errno.EADDRINUSE: "another process listens there; stop it or choose another port",
            errno.EADDRNOTAVAIL: "no interface of this machine has that address; use 127.0.0.1 or 0.0.0.0",
            errno.EACCES: "ports below 1024 need privileges; choose a port above 1023",
        }.get(exc.errno or 0, "choose another address or port")
        raise ListenerUnavailable(what, f"{host}:{port}", f"{exc.strerror or exc}; {hint}") from None
    return sock


def resolve(host: str, port: int, what: str) -> tuple[int, int, int, tuple]:
    """The family, type, protocol and address to bind for ``host``:``port`` (ListenerUnavailable if it does not resolve)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError, OverflowError) as exc:
        raise ListenerUnavailable(
            what,
            f"{host}:{port}",
            f"{host!r} is no address or resolvable host name ({exc}); give an IP address such as 127.0.0.1",
        ) from None
    return family, kind, proto, address


def listens_on(sock: socket.socket, host: str, port: int) -> bool:
    """Whether ``sock`` (a listener handed over by a predecessor) is bound where ``host``:``port`` would bind (0: any port)."""
    try:
        family, _, _, address = resolve(host, port, "")
        bound = sock.getsockname()
    except (ListenerUnavailable, OSError):
        return False
    return sock.family == family and bound[0] == address[0] and port in (0, bound[1])


def check_listening(sock: socket.socket, what: str) -> None:
    """ListenerUnavailable unless ``sock`` is a socket that accepts connections (a bound one, or one handed over)."""
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        address = sock.getsockname()
    except OSError as exc:
        raise ListenerUnavailable(what, "?", f"not a usable socket ({exc.strerror or exc})") from None
    if not listening:
        raise ListenerUnavailable(what, str(address), "the socket does not listen")


@attrs.define(eq=False)
class _Connection:
    sock: socket.socket
    deadline: float
    received: bytearray = attrs.field(factory=bytearray)
    answer: bytes = b""


class HttpEndpoint:
    """Answers GET and HEAD for ``routes`` (path -> Route) on ``listener``, in one thread, until ``close``."""

    def __init__(
        self,
        listener: socket.socket,
        routes: dict[str, Route],
        max_connections: int = MAX_CONNECTIONS,
        deadline_s: float = DEADLINE_S,
    ):
        self.listener = listener
        self.routes = routes
        self.max_connections = max_connections
        self.deadline_s = deadline_s
        self.displaced = 0  # connections closed to make room, since the start
        self.expired = 0  # connections closed at their deadline
        self._connections: dict[socket.socket, _Connection] = {}  # in accept order: the first is the oldest
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._grace_until: float | None = None  # set by close(): no more accepts, answer what is in flight until then
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, daemon=True, name="http-endpoint")

    @property
    def address(self) -> tuple[str, int]:
        return typing.cast("tuple[str, int]", self.listener.getsockname()[:2])

    def start(self) -> None:
        self._thread.start()

    def close(self, grace_s: float = 1.0) -> None:
        """Stop accepting, answer the connections accepted already (for at most ``grace_s``), close them all and stop.

        The listener is the caller's to close: it may have been handed over, and a successor accepting on it
        answers whoever connects next.
        """
        self._grace_until = time.monotonic() + grace_s
        try:
            os.write(self._wake_write, b"x")
        except OSError:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=grace_s + 5)
        for connection in list(self._connections.values()):
            self._drop(connection)
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _loop(self) -> None:
        while True:
            if self._grace_until is not None:
                if "listener" in (key.data for key in self._selector.get_map().values()):
                    self._selector.unregister(self.listener)
                if not self._connections or time.monotonic() > self._grace_until:
                    return
            oldest = next(iter(self._connections.values()), None)
            timeout = 1.0 if oldest is None else max(0.0, min(1.0, oldest.deadline - time.monotonic()))
            for key, mask in self._selector.select(timeout):
                try:
                    if key.data == "wake":
                        os.read(self._wake_read, 64)
                        continue
                    if key.data == "listener":
                        self._accept()
                    elif isinstance(key.data, _Connection):
                        self._serve(key.data, mask)
                except Exception:  # a bug must not end the endpoint: log it, drop that connection
                    log.exception("unexpected error in the HTTP endpoint")
                    if isinstance(key.data, _Connection):
                        self._drop(key.data)
            now = time.monotonic()
            while self._connections and (first := next(iter(self._connections.values()))).deadline <= now:
                self.expired += 1
                self._drop(first)

    def _accept(self) -> None:
        for _ in range(self.max_connections):  # what is queued, in rounds: the selector is asked again between them
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:
                    raise
                if not self._connections:
                    time.sleep(0.05)
                    return
                self.displaced += 1
                self._drop(next(iter(self._connections.values())))
                continue
            if len(self._connections) >= self.max_connections:
                self.displaced += 1
                self._drop(next(iter(self._connections.values())))
            sock.setblocking(False)
            connection = _Connection(sock, time.monotonic() + self.deadline_s)
            self._connections[sock] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _serve(self, connection: _Connection, mask: int) -> None:
        if mask & selectors.EVENT_READ and not connection.answer:
            try:
                data = connection.sock.recv(MAX_REQUEST_BYTES + 1 - len(connection.received))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(connection)
                return
            if not data:
                self._drop(connection)
                return
            connection.received += data
            end = connection.received.find(b"\r\n\r\n")
            if end < 0 and b"\n\n" in connection.received:
                end = connection.received.find(b"\n\n")
            if end >= 0:
                self._answer(connection, self._respond(bytes(connection.received[:end])))
            elif len(connection.received) > MAX_REQUEST_BYTES:
                self._answer(connection, (Response.text(431, f"a request head is at most {MAX_REQUEST_BYTES} bytes"), False))
        if mask & selectors.EVENT_WRITE and connection.answer:
            try:
                sent = connection.sock.send(connection.answer)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(connection)
                return
            connection.answer = connection.answer[sent:]
            if not connection.answer:
                self._drop(connection)

    def _respond(self, head: bytes) -> tuple[Response, bool]:
        """The response to a request head, and whether it goes without a body (HEAD)."""
        parts = head.split(b"\r\n" if b"\r\n" in head else b"\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return Response.text(400, "expected a request line: GET PATH HTTP/1.1"), False
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return Response.text(405, "only GET and HEAD are served"), False
        route = self.routes.get(target.split("?", 1)[0])
        if route is None:
            return Response.text(404, f"no such path; served: {', '.join(sorted(self.routes))}"), method == "HEAD"
        try:
            return route(), method == "HEAD"
        except Exception as exc:
            log.exception("answering %s failed", target[:80])
            return Response.text(500, f"the server failed to answer: {exc!s:.200}"), method == "HEAD"

    def _answer(self, connection: _Connection, response: tuple[Response, bool]) -> None:
        connection.answer = response[0].encode(head_only=response[1])
        self._selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
        self._serve(connection, selectors.EVENT_WRITE)  # most answers fit the send buffer: no second trip

    def _drop(self, connection: _Connection) -> None:
        if self._connections.pop(connection.sock, None) is None:
            return
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()
