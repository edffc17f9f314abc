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

    def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)

    def counter(name: str, text: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(f"{PREFIX}_{name}", text, value=value)

    def labelled(family: typing.Any, label: str, values: dict) -> typing.Any:
        for key, value in sorted(values.items()):
            family.add_metric([str(key)], value)
        return family

    yield gauge("uptime_seconds", "Seconds since the server started.", snapshot["uptime_s"])
    yield gauge("entries", "Entries held.", snapshot["entries"])
    yield labelled(
        GaugeMetricFamily(
            f"{PREFIX}_entries_by_device", "Entries held per device (cpu, host tier, GPU UUID).", labels=["device"]
        ),
        "device",
        snapshot["entries_by_device"],
    )
    tiers = snapshot["tiers"]
    yield labelled(
        GaugeMetricFamily(f"{PREFIX}_held_bytes", "Bytes held per tier (host, or a GPU's UUID).", labels=["tier"]),
        "tier",
        {tier: held["held"] for tier, held in tiers.items()},
    )
    yield labelled(
        GaugeMetricFamily(
            f"{PREFIX}_budget_bytes", "Byte budget per tier (tiers without a budget are left out).", labels=["tier"]
        ),
        "tier",
        {tier: held["budget"] for tier, held in tiers.items() if held.get("budget")},
    )
    budgets = snapshot["budgets"]
    if budgets.get("total"):
        yield gauge("total_budget_bytes", "The server's byte budget over all tiers (--byte-budget).", budgets["total"])
    yield counter("hits", "Attach requests answered with an entry.", snapshot["hits"])
    yield counter("misses", "Attach requests for a fingerprint the server does not hold.", snapshot["misses"])
    yield counter("publishes", "Entries published.", snapshot["publishes"])
    yield labelled(
        CounterMetricFamily(
            f"{PREFIX}_fallbacks", "Disk loads engines reported instead of an attach, by reason.", labels=["reason"]
        ),
        "reason",
        snapshot["fallbacks"],
    )
    yield labelled(
        CounterMetricFamily(f"{PREFIX}_evictions", "Entries dropped, by reason (budget, request, stopping).", labels=["reason"]),
        "reason",
        snapshot["evictions"],
    )
    yield labelled(
        CounterMetricFamily(f"{PREFIX}_refusals", "Requests and connections refused, by error code.", labels=["code"]),
        "code",
        snapshot["refusals"],
    )
    histogram = snapshot["attach_seconds"]
    buckets = [(f"{bound:g}", count) for bound, count in histogram["buckets"]] + [("+Inf", histogram["count"])]
    yield HistogramMetricFamily(
        f"{PREFIX}_attach_seconds",
        "Time the server took to answer an attach that found its entry.",
        buckets=buckets,
        sum_value=histogram["sum"],
    )
    yield gauge("connections_open", "Connections open now.", snapshot["connections_open"])
    yield counter("connections", "Connections accepted since the start.", snapshot["connections_total"])


class _Collector:
    """A prometheus-client collector that reads a fresh snapshot at each scrape."""

    def __init__(self, snapshot: "Callable[[], dict]"):
        self._snapshot = snapshot

    def collect(self) -> "Iterator":
        return _metric_families(self._snapshot())


def render(snapshot: dict) -> bytes:
    """``snapshot`` in Prometheus' text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(lambda: snapshot))
    return generate_latest(registry)


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
