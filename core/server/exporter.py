"""The server's metrics in Prometheus' text format, and its health probes, over HTTP (``serve --metrics-port``).

Needs the optional ``metrics`` extra (``pip install 'weightcache[metrics]'``: prometheus-client, which
imports neither torch nor CUDA). What is exported is exactly ``Metrics.snapshot`` (the ``metrics`` field
of ``weightcache status --json``), read at each scrape; names and labels are in docs/operations.md.
"""

from __future__ import annotations

import logging
import socket
import typing

import attrs

from weightcache.core.server.http_endpoint import HttpEndpoint, Response, check_listening

if typing.TYPE_CHECKING:
    from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

PREFIX = "weightcache"


def _metric_families(snapshot: dict) -> "Iterator":
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def family(kind: type, name: str, text: str, value: typing.Any, label: str | None = None) -> typing.Any:
        """One metric: ``value`` a number, or with ``label`` a mapping from label values to numbers."""
        if label is None:
            return kind(f"{PREFIX}_{name}", text, value=value)
        labelled = kind(f"{PREFIX}_{name}", text, labels=[label])
        for key, number in sorted(value.items()):
            labelled.add_metric([str(key)], number)
        return labelled

    tiers, budgets = snapshot["tiers"], snapshot["budgets"]
    gauges = [
        ("uptime_seconds", "Seconds since the server started.", snapshot["uptime_s"], None),
        ("entries", "Entries held.", snapshot["entries"], None),
        ("entries_by_device", "Entries held per device (cpu, host tier, GPU UUID).", snapshot["entries_by_device"], "device"),
        ("held_bytes", "Bytes held per tier (host, or a GPU's UUID).", {t: held["held"] for t, held in tiers.items()}, "tier"),
        (
            "budget_bytes",
            "Byte budget per tier (tiers without a budget are left out).",
            {t: held["budget"] for t, held in tiers.items() if held.get("budget")},
            "tier",
        ),
        ("connections_open", "Connections open now.", snapshot["connections_open"], None),
        (
            "ready",
            "1 while the server listens and is not stopping or handing over (as /readyz answers).",
            int(snapshot["ready"]),
            None,
        ),
        (
            "unverified_entries",
            "Entries back from a crash (the fd store) that nobody has checksummed yet.",
            snapshot["unverified_entries"],
            None,
        ),
        ("fdstore", "1 when the server keeps its entries' fds in systemd's fd store.", int(snapshot["fdstore"]), None),
        ("fdstore_fds", "Fds the server keeps in systemd's fd store (2 + arenas per entry).", snapshot["fdstore_fds"], None),
        ("warm_items", "Items of the warm list (--config) per state.", snapshot["warm_items"], "state"),
    ]
    if budgets.get("total"):
        gauges.append(("total_budget_bytes", "The server's byte budget over all tiers (--byte-budget).", budgets["total"], None))
    counters = [
        ("hits", "Attach requests answered with an entry.", snapshot["hits"], None),
        ("misses", "Attach requests for a fingerprint the server does not hold.", snapshot["misses"], None),
        ("publishes", "Entries published.", snapshot["publishes"], None),
        ("fallbacks", "Disk loads engines reported instead of an attach, by reason.", snapshot["fallbacks"], "reason"),
        ("evictions", "Entries dropped, by reason (budget, request, stopping).", snapshot["evictions"], "reason"),
        ("refusals", "Requests and connections refused, by error code.", snapshot["refusals"], "code"),
        ("connections", "Connections accepted since the start.", snapshot["connections_total"], None),
        (
            "fdstore_failures",
            "Entries the server could not keep in (or remove from) systemd's fd store.",
            snapshot["fdstore_failures"],
            None,
        ),
    ]
    build = snapshot["build"]
    info = GaugeMetricFamily(f"{PREFIX}_build_info", "The server's version, protocol and Python; always 1.", labels=sorted(build))
    info.add_metric([str(build[key]) for key in sorted(build)], 1)
    yield info
    for row in gauges:
        yield family(GaugeMetricFamily, *row)
    for row in counters:
        yield family(CounterMetricFamily, *row)
    histogram = snapshot["attach_seconds"]
    buckets = [(f"{bound:g}", count) for bound, count in histogram["buckets"]] + [("+Inf", histogram["count"])]
    yield HistogramMetricFamily(
        f"{PREFIX}_attach_seconds",
        "Time the server took to answer an attach that found its entry.",
        buckets=buckets,
        sum_value=histogram["sum"],
    )


class _Collector:
    """A prometheus-client collector that reads a fresh snapshot at each scrape."""

    def __init__(self, snapshot: "Callable[[], dict]"):
        self._snapshot = snapshot

    def collect(self) -> "Iterator":
        return _metric_families(self._snapshot())


@attrs.frozen
class Verdict:
    """A health answer: ``ok`` and why (the body of ``/healthz`` and ``/readyz``)."""

    ok: bool
    reason: str

    def response(self) -> Response:
        return Response.text(200 if self.ok else 503, f"{'ok' if self.ok else 'not ok'}: {self.reason}")


class Exporter:
    """``/metrics`` (also ``/``), ``/healthz`` and ``/readyz`` over HTTP on a listener the server bound or was handed.

    ``snapshot`` gives the metrics' JSON at each scrape; ``alive`` and ``ready`` answer the probes. Construct it
    before binding anything: it raises ImportError, with the install command, without prometheus-client.
    """

    def __init__(self, snapshot: "Callable[[], dict]", alive: "Callable[[], Verdict]", ready: "Callable[[], Verdict]"):
        try:
            from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        except ImportError:
            raise ImportError(
                "--metrics-port needs prometheus-client; install it with `pip install 'weightcache[metrics]'`"
            ) from None
        from prometheus_client import ProcessCollector

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(snapshot))
        ProcessCollector(registry=registry)  # process_open_fds against process_max_fds (every arena is an fd), memory, CPU

        def metrics() -> Response:
            return Response(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        self.routes = {"/metrics": metrics, "/": metrics, "/healthz": lambda: alive().response()}
        self.routes["/readyz"] = lambda: ready().response()
        self.endpoint: HttpEndpoint | None = None

    def serve(self, listener: socket.socket) -> None:
        """Answer on ``listener`` (bound and listening) in a thread of its own."""
        check_listening(listener, "--metrics-port")
        self.endpoint = HttpEndpoint(listener, self.routes)
        self.endpoint.start()
        host, port = self.endpoint.address
        log.info("metrics on http://%s:%d/metrics (probes: /healthz, /readyz)", host, port)

    def close(self) -> None:
        """Stop answering; the listener stays open (it is the server's, and may have been handed over)."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
