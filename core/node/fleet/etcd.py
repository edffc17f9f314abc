"""A small etcd v3 client over etcd's own HTTP/JSON gateway (``/v3/kv/...``, ``/v3/lease/...``, ``/v3/watch``): no
client package.

Every request has a deadline: the whole call, across every endpoint tried, takes at
most ``deadline_s``, and a store that does not answer in time raises FleetUnavailable.
Keys and values are bytes; the gateway carries them base64-encoded.

A ``Watch`` on one key is the gateway's streaming ``/v3/watch``: a thread of its own
reads the stream and wakes whoever waits (``Watch.wait``) when the key changes. It only
wakes: a caller reads the key itself after each wait, and every wait has a timeout, so a
watch that never starts, breaks (etcd killed) or hangs (etcd stopped) costs the caller
its polling interval, never a hang and never a wrong value.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import threading
import time
import typing
import urllib.error
import urllib.parse
import urllib.request

import attrs

from weightcache.core.errors import FleetUnavailable

MAX_REPLY_BYTES: typing.Final = 64 << 20
"""Largest gateway reply read (a range over many holders stays far below)."""


def endpoints_tuple(endpoints: typing.Iterable[str]) -> tuple[str, ...]:
    """The endpoints as a tuple (an attrs converter)."""
    return tuple(endpoints)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with ``prefix`` (etcd's ``range_end`` for a prefix)."""
    end = bytearray(prefix)
    for index in reversed(range(len(end))):
        if end[index] < 0xFF:
            end[index] += 1
            return bytes(end[: index + 1])
    return b"\0"


@attrs.frozen
class KeyValue:
    """One key of a range reply, with the lease it lives under (0: none) and the revision that created it."""

    key: bytes
    value: bytes
    lease: int = 0
    create_revision: int = 0


@attrs.define
class EtcdStore:
    """The registry's store: etcd at ``endpoints`` (``http://127.0.0.1:2379``), each call bounded by ``deadline_s``."""

    endpoints: tuple[str, ...] = attrs.field(converter=endpoints_tuple)
    deadline_s: float = 2.0

    def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` on the first endpoint that answers; FleetUnavailable when none does in time."""
        deadline = time.monotonic() + self.deadline_s
        problems = []
        data = json.dumps(body).encode()
        for endpoint in self.endpoints:
            left = deadline - time.monotonic()
            if left <= 0:
                problems.append(f"no time left for {endpoint}")
                break
            request = urllib.request.Request(
                endpoint.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                raw = _post(request, deadline)
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
                late = time.monotonic() >= deadline
                why = f"no whole reply within {self.deadline_s:g} s" if late else getattr(exc, "reason", exc)
                problems.append(f"{endpoint}: {why}")
                continue
            if len(raw) > MAX_REPLY_BYTES:
                problems.append(f"{endpoint}: a reply of more than {MAX_REPLY_BYTES} bytes")
                continue
            try:
                answer = json.loads(raw)
            except (ValueError, RecursionError):
                problems.append(f"{endpoint}: a reply that is not JSON, or nested too deep")
                continue
            if not isinstance(answer, dict):
                problems.append(f"{endpoint}: a reply that is not a JSON object")
                continue
            return answer
        raise FleetUnavailable(self.endpoints, "; ".join(problems) or "no endpoint configured")

    def range(self, prefix: bytes) -> list[KeyValue]:
        """Every key that starts with ``prefix``, with its value and lease."""
        answer = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return self._kvs(answer.get("kvs", []))

    def _kvs(self, items: object) -> list[KeyValue]:
        """The keys of a range reply; FleetUnavailable for a reply of another shape (not etcd's gateway)."""
        try:
            if not isinstance(items, list):
                raise ValueError(f"kvs is {type(items).__name__}")
            return [_key_value(item) for item in items]
        except (ValueError, TypeError) as exc:
            raise FleetUnavailable(self.endpoints, f"a range reply of another shape ({str(exc)[:80]})") from None

    def get(self, key: bytes) -> bytes | None:
        found = self.get_item(key)
        return found.value if found is not None else None

    def get_item(self, key: bytes) -> KeyValue | None:
        """``key`` with its value, lease and create revision; None when it does not exist."""
        answer = self.call("/v3/kv/range", {"key": _b64(key)})
        found = self._kvs(answer.get("kvs", []))
        return found[0] if found else None

    def watch(self, key: bytes) -> "Watch":
        """A watch on ``key`` (started in a thread of its own; ``Watch.close`` ends it)."""
        return Watch(self.endpoints, key, self.deadline_s)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})

    def create(self, key: bytes, value: bytes, lease: int = 0) -> bytes | None:
        """Put ``value`` at ``key`` only if the key does not exist; None when it was created, else the value it holds."""
        answer = self.call(
            "/v3/kv/txn",
            {
                "compare": [{"key": _b64(key), "target": "CREATE", "create_revision": "0"}],
                "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": str(lease)}}],
                "failure": [{"request_range": {"key": _b64(key)}}],
            },
        )
        if answer.get("succeeded"):
            return None
        responses = answer.get("responses", [])
        for response in responses if isinstance(responses, list) else []:
            found = response.get("response_range", {}) if isinstance(response, dict) else {}
            kvs = self._kvs(found.get("kvs", []) if isinstance(found, dict) else None)
            if kvs:
                return kvs[0].value
        return b""  # deleted between the compare and the range: taken, with nothing to show

    def delete(self, key: bytes) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        answer = self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        try:
            return int(answer["ID"])
        except (KeyError, TypeError, ValueError):
            raise FleetUnavailable(self.endpoints, "a lease grant's reply without a lease") from None

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the seconds it now has left (0: it had expired, its keys are gone)."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        result = answer.get("result", {})
        try:
            return int(result.get("TTL", 0) if isinstance(result, dict) else 0)
        except (TypeError, ValueError):
            raise FleetUnavailable(self.endpoints, "a keepalive's reply without a TTL") from None

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: every key put under it is deleted."""
        self.call("/v3/lease/revoke", {"ID": str(lease)})


class Watch:
    """Changes of one key, streamed by the gateway's ``/v3/watch``: ``changes`` counts the events seen so far.

    A caller notes ``changes`` before it reads the key, and after reading calls ``wait(noted, timeout_s)``, which
    returns as soon as an event came after the note (or the timeout passed, or the watch broke): no change is missed
    between the read and the wait. ``live`` says whether etcd has confirmed the watch and it still streams; until
    then, and once ``broken`` names why it ended, a caller should wait no longer than it would poll.
    """

    def __init__(self, endpoints: typing.Sequence[str], key: bytes, deadline_s: float):
        self.endpoints = tuple(endpoints)
        self.key = key
        self.deadline_s = deadline_s
        self.changes = 0
        self.latest: KeyValue | None = None
        """The key as the last event left it (None: deleted, or no event yet); ``last`` reads it with ``changes``."""
        self.broken: str | None = None
        self._created = False
        self._closed = False
        self._socket: socket.socket | None = None
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="weightcache-etcd-watch", daemon=True)
        self._thread.start()

    @property
    def live(self) -> bool:
        return self._created and self.broken is None and not self._closed

    def last(self) -> tuple[int, KeyValue | None]:
        """``changes`` and ``latest``, read together."""
        with self._lock:
            return self.changes, self.latest

    def wait(self, seen: int, timeout_s: float) -> int:
        """Wait until an event came after ``seen`` (the value of ``changes`` noted before reading the key), the watch
        ended, or ``timeout_s`` passed; returns ``changes``."""
        with self._lock:
            self._lock.wait_for(lambda: self.changes != seen or self.broken is not None or self._closed, timeout_s)
            return self.changes

    def close(self) -> None:
        """End the stream (its thread ends with it); waiters return."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            sock = self._socket
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=self.deadline_s)

    def _run(self) -> None:
        problems = []
        for endpoint in self.endpoints:
            try:
                self._stream(endpoint)
                return
            except (OSError, ValueError, TypeError, RecursionError, http.client.HTTPException) as exc:
                problems.append(f"{endpoint}: {type(exc).__name__}: {str(exc)[:200]}")
                if self._created or self._closed:  # (it broke after etcd confirmed it: not another endpoint's turn)
                    break
        self._end("; ".join(problems) or "no endpoint configured")

    def _stream(self, endpoint: str) -> None:
        """Open the watch at ``endpoint`` and count its events until the stream ends (``_end`` with why)."""
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"a watch needs an http:// endpoint, not {endpoint!r}")
        connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=self.deadline_s)
        try:
            connection.connect()
            with self._lock:
                if self._closed:
                    return
                self._socket = connection.sock
            body = json.dumps({"create_request": {"key": _b64(self.key)}})
            connection.request("POST", "/v3/watch", body=body, headers={"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                raise ValueError(f"HTTP {reply.status} for /v3/watch")
            connection.sock.settimeout(None)  # a quiet key sends nothing for long; close() shuts the socket down
            pending = b""
            decoder = json.JSONDecoder()
            while True:
                data = reply.read1(1 << 16)
                if not data:
                    break
                pending += data
                if len(pending) > MAX_REPLY_BYTES:
                    raise ValueError(f"a watch message of more than {MAX_REPLY_BYTES} bytes")
                while pending.strip():
                    text = pending.decode().lstrip()
                    try:
                        message, end = decoder.raw_decode(text)
                    except ValueError:
                        break  # (the rest of this message is still on its way)
                    pending = text[end:].encode()
                    self._take(message)
        finally:
            with self._lock:
                self._socket = None
            connection.close()
        self._end("etcd ended the watch's stream")

    def _take(self, message: object) -> None:
        result = message.get("result") if isinstance(message, dict) else None
        if not isinstance(result, dict):
            raise ValueError(f"a watch message that is not a result: {str(message)[:200]}")
        if result.get("canceled"):
            raise ValueError(f"etcd canceled the watch ({result.get('cancel_reason', 'no reason given')})")
        events = result.get("events", [])
        if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
            raise ValueError(f"a watch message whose events are not a list of objects: {str(events)[:200]}")
        with self._lock:
            if result.get("created"):
                self._created = True
            for event in events:
                self.latest = None if event.get("type") == "DELETE" else _key_value(event.get("kv", {}))
            self.changes += len(events)
            self._lock.notify_all()

    def _end(self, why: str) -> None:
        with self._lock:
            if self.broken is None and not self._closed:
                self.broken = why
            self._lock.notify_all()


def _post(request: urllib.request.Request, deadline: float) -> bytes:
    """The body of the reply to ``request`` (at most ``MAX_REPLY_BYTES`` + 1 bytes), all of it by ``deadline``
    (``time.monotonic``): a socket timeout bounds each read only, and a server that sends a byte at a time would hold
    a reply for as long as it likes, so the connection is shut down at the deadline, whatever it is doing."""
    guard = _Deadline(deadline)
    opener = urllib.request.build_opener(*guard.handlers())
    left = deadline - time.monotonic()
    try:
        with opener.open(request, timeout=max(left, 0.001)) as reply:
            raw = reply.read(MAX_REPLY_BYTES + 1)
        if guard.expired:  # (a read the shutdown cut short may end as if the reply were whole)
            raise TimeoutError("the deadline passed")
        return raw
    finally:
        guard.cancel()


class _Deadline:
    """Shuts down the connections made through ``handler()`` at ``deadline``, unless cancelled first."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.expired = False

    def handlers(self) -> list[urllib.request.BaseHandler]:
        """An http and an https handler whose connections this guard shuts down at the deadline."""
        guard = self

        class Connection(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                guard.watch(self.sock)

        class SecureConnection(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                guard.watch(self.sock)

        class Handler(urllib.request.HTTPHandler):
            def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(Connection, req)

        class SecureHandler(urllib.request.HTTPSHandler):
            def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(SecureConnection, req, context=self._context)  # type: ignore[attr-defined]

        return [Handler(), SecureHandler()]

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self._timer is None:
                self._timer = threading.Timer(max(self.deadline - time.monotonic(), 0), self._expire)
                self._timer.daemon = True
                self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._sockets.clear()


def _key_value(item: dict) -> KeyValue:
    if not isinstance(item, dict):
        raise ValueError("a key that is not an object")
    return KeyValue(
        base64.b64decode(item.get("key", "")),
        base64.b64decode(item.get("value", "")),
        int(item.get("lease", 0) or 0),
        int(item.get("create_revision", 0) or 0),
    )
