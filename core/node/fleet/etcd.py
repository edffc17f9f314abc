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
import ssl
import threading
import time
import typing
import urllib.error
import urllib.parse
import urllib.request

import attrs

from weightcache.core.errors import FleetUnavailable
from weightcache.core.node.fleet.etcd_access import EtcdAccess

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
    """The registry's store: etcd at ``endpoints`` (``http://127.0.0.1:2379``), each call bounded by ``deadline_s``;
    ``access``: TLS files and a user/password (``etcd_access``)."""

    endpoints: tuple[str, ...] = attrs.field(converter=endpoints_tuple)
    deadline_s: float = 2.0
    access: EtcdAccess = attrs.field(factory=EtcdAccess)
    _token: str | None = attrs.field(default=None, init=False, repr=False)

    def call(self, path: str, body: dict) -> dict:
        """POST ``body`` to ``path`` on the first endpoint that answers; FleetUnavailable when none does in time, naming
        what went wrong: unreachable, a certificate refused (either way), the user or password refused."""
        deadline = time.monotonic() + self.deadline_s
        problems: list[_Problem] = []
        for endpoint in self.endpoints:
            left = deadline - time.monotonic()
            if left <= 0:
                problems.append(_Problem(UNREACHABLE, f"no time left for {endpoint}"))
                break
            try:
                return self._call_once(endpoint, path, body, deadline)
            except _Refused as refused:
                problems.append(refused.problem)
        raise _unavailable(self.endpoints, problems)

    def _call_once(self, endpoint: str, path: str, body: dict, deadline: float) -> dict:
        """One endpoint: authenticate if a user is set (once per token; again once if etcd says it expired)."""
        for attempt in range(2):
            headers = {"Content-Type": "application/json"}
            if self.access.user is not None:
                if self._token is None:
                    answer = self._post(
                        endpoint,
                        "/v3/auth/authenticate",
                        {"name": self.access.user, "password": self.access.password},
                        {"Content-Type": "application/json"},
                        deadline,
                    )
                    if not isinstance(answer.get("token"), str):
                        raise _Refused(_Problem(AUTH, f"{endpoint}: etcd gave no token for user {self.access.user!r}"))
                    self._token = answer["token"]
                headers["Authorization"] = typing.cast(str, self._token)
            try:
                return self._post(endpoint, path, body, headers, deadline)
            except _Refused as refused:
                if refused.problem.kind != AUTH or self._token is None or attempt:
                    raise
                self._token = None  # an expired token: authenticate again, once
        raise AssertionError("unreachable")

    def _post(self, endpoint: str, path: str, body: dict, headers: dict, deadline: float) -> dict:
        request = urllib.request.Request(
            endpoint.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        context = self.access.context if endpoint.startswith("https://") else None
        try:
            raw = _post(request, deadline, context)
        except urllib.error.HTTPError as exc:
            raise _Refused(_http_problem(endpoint, exc)) from None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            if time.monotonic() >= deadline:
                late = f"{endpoint}: no whole reply within {self.deadline_s:g} s"
                raise _Refused(_Problem(UNREACHABLE, late)) from None
            raise _Refused(_connection_problem(endpoint, getattr(exc, "reason", exc), self.access)) from None
        if len(raw) > MAX_REPLY_BYTES:
            raise _Refused(_Problem(UNREACHABLE, f"{endpoint}: a reply of more than {MAX_REPLY_BYTES} bytes"))
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError):
            raise _Refused(_Problem(UNREACHABLE, f"{endpoint}: a reply that is not JSON, or nested too deep")) from None
        if not isinstance(answer, dict):
            raise _Refused(_Problem(UNREACHABLE, f"{endpoint}: a reply that is not a JSON object"))
        return answer

    def auth_headers(self) -> dict:
        """The Authorization header of a request outside ``call`` (a watch): a token, fetched if none is held yet."""
        if self.access.user is None:
            return {}
        if self._token is None:
            self.call("/v3/auth/authenticate", {"name": self.access.user, "password": self.access.password})
        return {"Authorization": self._token} if self._token else {}

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
        return Watch(self.endpoints, key, self.deadline_s, self.access.context, self.auth_headers)

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

    def __init__(
        self,
        endpoints: typing.Sequence[str],
        key: bytes,
        deadline_s: float,
        context: ssl.SSLContext | None = None,
        headers: typing.Callable[[], dict] = dict,
    ):
        self.endpoints = tuple(endpoints)
        self.key = key
        self.deadline_s = deadline_s
        self._context = context
        self._headers = headers
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
            except (OSError, ValueError, TypeError, RecursionError, http.client.HTTPException, FleetUnavailable) as exc:
                problems.append(f"{endpoint}: {type(exc).__name__}: {str(exc)[:200]}")
                if self._created or self._closed:  # (it broke after etcd confirmed it: not another endpoint's turn)
                    break
        self._end("; ".join(problems) or "no endpoint configured")

    def _stream(self, endpoint: str) -> None:
        """Open the watch at ``endpoint`` and count its events until the stream ends (``_end`` with why)."""
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"a watch needs an http:// or https:// endpoint, not {endpoint!r}")
        headers = {"Content-Type": "application/json", **self._headers()}
        connection: http.client.HTTPConnection
        if url.scheme == "https":
            connection = http.client.HTTPSConnection(
                url.hostname, url.port or 443, timeout=self.deadline_s, context=self._context
            )
        else:
            connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=self.deadline_s)
        try:
            connection.connect()
            with self._lock:
                if self._closed:
                    return
                self._socket = connection.sock
            body = json.dumps({"create_request": {"key": _b64(self.key)}})
            connection.request("POST", "/v3/watch", body=body, headers=headers)
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


UNREACHABLE: typing.Final = "unreachable"
CERTIFICATE: typing.Final = "certificate"
AUTH: typing.Final = "auth"
_ORDER = (CERTIFICATE, AUTH, UNREACHABLE)  # the most telling kind first: it names what to fix


@attrs.frozen
class _Problem:
    kind: str
    text: str


class _Refused(Exception):
    """One endpoint's failure, carried to ``call``."""

    def __init__(self, problem: _Problem):
        super().__init__(problem.text)
        self.problem = problem


def _unavailable(endpoints: tuple[str, ...], problems: list[_Problem]) -> FleetUnavailable:
    kinds = {problem.kind for problem in problems} or {UNREACHABLE}
    kind = next(kind for kind in _ORDER if kind in kinds)
    return FleetUnavailable(endpoints, "; ".join(p.text for p in problems) or "no endpoint configured", kind)


def _http_problem(endpoint: str, exc: urllib.error.HTTPError) -> _Problem:
    """An HTTP error of the gateway: auth refused (no token, a bad one, a wrong password, no permission), or other."""
    try:
        raw = exc.read(4096)
    except OSError:
        raw = b""
    try:
        found = json.loads(raw)
        message = str(found.get("message") or found.get("error")) if isinstance(found, dict) else ""
    except ValueError:
        message = raw.decode(errors="replace")  # the gateway's own refusals are plain text
    message = message.strip() or str(exc.reason)
    text = f"{endpoint}: HTTP {exc.code}: {str(message).strip()[:300]}"
    lowered = str(message).lower()
    if "commonname" in lowered:  # etcd's gateway, with auth enabled, refuses a client certificate that has a CN
        return _Problem(
            CERTIFICATE,
            f"{text}: etcd refused this node's client certificate because it has a CommonName, which its HTTP gateway "
            "refuses while auth is enabled; issue the node a certificate without a CN (its subjectAltName is enough)",
        )
    if exc.code in (401, 403) or any(word in lowered for word in ("auth", "permission denied", "user name", "token")):
        return _Problem(AUTH, text)
    return _Problem(UNREACHABLE, text)


def _connection_problem(endpoint: str, reason: object, access: "EtcdAccess") -> _Problem:
    """A failure below HTTP: a certificate refused by this node (etcd's does not verify) or by etcd (this node's), or
    nobody answering."""
    text = str(reason)
    if isinstance(reason, ssl.SSLCertVerificationError):
        where = access.ca_file or "the system's CAs"
        return _Problem(
            CERTIFICATE, f"{endpoint}: etcd's certificate does not verify against {where} ({reason.verify_message or text})"
        )
    upper = text.upper()
    if isinstance(reason, ssl.SSLError) or "CERTIFICATE" in upper or "UNKNOWN_CA" in upper:
        mine = "this node's client certificate" if access.cert_file else "a connection without a client certificate"
        return _Problem(CERTIFICATE, f"{endpoint}: etcd refused {mine} ({text})")
    if isinstance(reason, ConnectionResetError) and access.tls:
        return _Problem(CERTIFICATE, f"{endpoint}: etcd closed the TLS connection ({text}): a certificate it refused?")
    return _Problem(UNREACHABLE, f"{endpoint}: {text}")


def _post(request: urllib.request.Request, deadline: float, context: ssl.SSLContext | None = None) -> bytes:
    """The body of the reply to ``request`` (at most ``MAX_REPLY_BYTES`` + 1 bytes), all of it by ``deadline``
    (``time.monotonic``): a socket timeout bounds each read only, and a server that sends a byte at a time would hold
    a reply for as long as it likes, so the connection is shut down at the deadline, whatever it is doing."""
    guard = _Deadline(deadline)
    opener = urllib.request.build_opener(*guard.handlers(context))
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

    def handlers(self, context: ssl.SSLContext | None = None) -> list[urllib.request.BaseHandler]:
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

        return [Handler(), SecureHandler(context=context)]

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
