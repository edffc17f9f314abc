"""The server's metrics in Prometheus' text format over HTTP (``weightcache serve --metrics-port``).

Needs the optional ``metrics`` extra (``pip install 'weightcache[metrics]'``: prometheus-client, which
imports neither torch nor CUDA). What is exported is exactly ``Metrics.snapshot`` (the ``metrics`` field
of ``weightcache status --json``), read at each scrape; names and labels are in docs/operations.md.
"""

from __future__ import annotations

import logging
import typing

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
    ]
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


class Exporter:
    """An HTTP endpoint (``/metrics``, any path) serving the snapshots of ``snapshot`` in its own thread."""

    def __init__(self, snapshot: "Callable[[], dict]", port: int, host: str = "127.0.0.1"):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise ImportError(
                "--metrics-port needs prometheus-client; install it with `pip install 'weightcache[metrics]'`"
            ) from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(snapshot))
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host, self.port = self._server.server_address[:2]
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
