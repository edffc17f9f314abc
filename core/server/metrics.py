"""What the server counts for an operator: hits, misses, fallbacks, evictions, refusals, attach latency, connections.

Torch-free and dependency-free (the server imports it). ``Metrics.snapshot`` is the one JSON form: it goes into
every ``status`` reply (``weightcache status --json``, field ``metrics``) and is what the Prometheus exporter
(``weightcache.core.server.exporter``, the ``metrics`` extra) renders. Every counter starts at 0 with the server.

Fallbacks are the engines' to report: the server sees a miss, not whether the engine then loaded from disk.
A client that falls back sends a ``report`` request naming the kind (``FALLBACK_KINDS``); an older or a
crashed client simply reports nothing.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time

import attrs

log = logging.getLogger(__name__)

ATTACH_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Upper bounds of the attach latency histogram, in seconds (the server's side: lookup and fd duplication)."""

FALLBACK_KINDS = ("busy", "not_found", "unusable", "corrupt", "not_cacheable", "other")
"""Why an engine loaded from disk instead of attaching, as far as a server can be told: it was busy, it holds no
matching entry, the entry could not be mapped in the engine, its bytes failed their checksums there (an entry back
from a crash), or the checkpoint is nothing the cache serves (a hub
id not in the local cache, ``.bin`` weights). An engine that found no server or did not trust it tells nobody:
its log line is the record."""

EVICTION_REASONS = ("budget", "request", "stopping", "superseded")
"""Why entries left the server: to make room within a budget, ``weightcache evict``, the server stopping, a newer
version of theirs published or switched to (refit)."""

REFUSAL_CODES = (
    "access_denied",
    "ambiguous",
    "attached",
    "bad_request",
    "busy",
    "handover_failed",
    "not_found",
    "over_budget",
    "protocol_error",
    "refused",
    "too_large",
    "too_many",
    "version_conflict",
)
"""The error codes the server refuses with; each is counted from 0, so every label set exists from the start."""

_MAX_REFUSAL_CODES = 32  # codes come from the server's own replies; the cap only keeps a bug from growing the table


@attrs.define
class Histogram:
    """Cumulative-bucket counts as Prometheus shows them, plus the sum and count of observations."""

    bounds: tuple[float, ...] = ATTACH_BUCKETS_S
    counts: list[int] = attrs.field()
    total: float = 0.0
    count: int = 0

    @counts.default
    def _zeros(self) -> list[int]:
        return [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += value
        self.count += 1

    def to_json(self) -> dict:
        """``buckets``: ``[upper bound, cumulative count]`` pairs (the last bound is ``+Inf``, i.e. ``count``)."""
        cumulative, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            cumulative.append([bound, running])
        return {"buckets": cumulative, "sum": self.total, "count": self.count}


@attrs.define
class Metrics:
    """The server's counters; every method is safe from any connection thread."""

    started: float = attrs.field(factory=time.time)
    hits: int = 0
    misses: int = 0
    publishes: int = 0
    connections_total: int = 0
    fallbacks: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(FALLBACK_KINDS, 0))
    evictions: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    refusals: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(REFUSAL_CODES, 0))
    attach_seconds: Histogram = attrs.field(factory=Histogram)
    last_attach: float | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    def connected(self) -> None:
        with self._lock:
            self.connections_total += 1

    def answered(self, op: str, reply: dict, seconds: float, pid: int) -> None:
        """Count one answered request: an attach is a hit (with its latency) or a miss; any other refusal by code."""
        ok = reply.get("ok") is True
        error = reply.get("error")
        code = str(error.get("code", "error") if isinstance(error, dict) else "error")[:40]
        with self._lock:
            if op == "attach" and ok:
                self.hits += 1
                self.attach_seconds.observe(seconds)
                self.last_attach = time.time()
            elif op == "attach" and code == "not_found":
                self.misses += 1
            elif op == "publish" and ok:
                self.publishes += 1
            elif not ok:
                self._refused_locked(code)
        fields = {"op": op, "peer_pid": pid, **({"entry": reply["digest"]} if isinstance(reply.get("digest"), str) else {})}
        if op == "attach":
            what = f"attached {str(reply.get('digest', ''))[:12]}" if ok else f"attach missed ({code})"
            log.info("%s for pid %d in %.1f ms", what, pid, seconds * 1000, extra={**fields, "code": None if ok else code})
        elif not ok:
            log.info("refused %s from pid %d: %s", op, pid, code, extra={**fields, "code": code})

    def refused(self, code: str) -> None:
        """A connection refused before any request (too many connections, a foreign uid)."""
        with self._lock:
            self._refused_locked(code)

    def _refused_locked(self, code: str) -> None:
        if code in self.refusals or len(self.refusals) < _MAX_REFUSAL_CODES:
            self.refusals[code] = self.refusals.get(code, 0) + 1

    def fell_back(self, kind: str) -> str:
        """A client's report that it loaded from disk; an unknown kind counts as ``other``. Returns the kind counted."""
        kind = kind if kind in FALLBACK_KINDS else "other"
        with self._lock:
            self.fallbacks[kind] += 1
        return kind

    def evicted(self, digest: str, reason: str, pid: int | None = None) -> None:
        """Entry ``digest`` was dropped for ``reason`` (EVICTION_REASONS), during a request of ``pid`` (None: none)."""
        with self._lock:
            self.evictions[reason if reason in EVICTION_REASONS else "request"] += 1
        if pid is not None:
            log.info(
                "evicted %s (%s) during a request of pid %d",
                digest[:12],
                reason,
                pid,
                extra={"entry": digest, "reason": reason, "peer_pid": pid},
            )

    def snapshot(self, tiers: dict, budgets: dict, entries: int, open_connections: int) -> dict:
        """The counters as JSON, with the registry's gauges (``tiers``: bytes held and budget per tier) passed in."""
        with self._lock:
            return {
                "uptime_s": round(time.time() - self.started, 3),
                "started": self.started,
                "entries": entries,
                "tiers": tiers,
                "budgets": budgets,
                "hits": self.hits,
                "misses": self.misses,
                "publishes": self.publishes,
                "fallbacks": dict(self.fallbacks),
                "evictions": dict(self.evictions),
                "refusals": dict(self.refusals),
                "attach_seconds": self.attach_seconds.to_json(),
                "last_attach": self.last_attach,
                "connections_open": open_connections,
                "connections_total": self.connections_total,
            }
