"""A small etcd v3 client over etcd's own HTTP/JSON gateway (``/v3/kv/...``, ``/v3/lease/...``): no client package.

Every request has a deadline: the whole call, across every endpoint tried, takes at
most ``deadline_s``, and a store that does not answer in time raises FleetUnavailable.
Keys and values are bytes; the gateway carries them base64-encoded.
"""

from __future__ import annotations

import base64
import json
import time
import typing
import urllib.error
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
                with urllib.request.urlopen(request, timeout=left) as reply:
                    raw = reply.read(MAX_REPLY_BYTES + 1)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                problems.append(f"{endpoint}: {getattr(exc, 'reason', exc)}")
                continue
            if len(raw) > MAX_REPLY_BYTES:
                problems.append(f"{endpoint}: a reply of more than {MAX_REPLY_BYTES} bytes")
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                problems.append(f"{endpoint}: a reply that is not JSON")
                continue
            if not isinstance(answer, dict):
                problems.append(f"{endpoint}: a reply that is not a JSON object")
                continue
            return answer
        raise FleetUnavailable(self.endpoints, "; ".join(problems) or "no endpoint configured")

    def range(self, prefix: bytes) -> list[KeyValue]:
        """Every key that starts with ``prefix``, with its value and lease."""
        answer = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_key_value(item) for item in answer.get("kvs", [])]

    def get(self, key: bytes) -> bytes | None:
        answer = self.call("/v3/kv/range", {"key": _b64(key)})
        found = [_key_value(item) for item in answer.get("kvs", [])]
        return found[0].value if found else None

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
        for response in answer.get("responses", []):
            kvs = response.get("response_range", {}).get("kvs", [])
            if kvs:
                return _key_value(kvs[0]).value
        return b""  # deleted between the compare and the range: taken, with nothing to show

    def delete(self, key: bytes) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        answer = self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(answer["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the seconds it now has left (0: it had expired, its keys are gone)."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: every key put under it is deleted."""
        self.call("/v3/lease/revoke", {"ID": str(lease)})


def _key_value(item: dict) -> KeyValue:
    return KeyValue(
        base64.b64decode(item.get("key", "")),
        base64.b64decode(item.get("value", "")),
        int(item.get("lease", 0) or 0),
        int(item.get("create_revision", 0) or 0),
    )
