"""Prometheus metrics of the bridges (docs/metrics.md).

One :class:`BridgeMetrics` owns one set of metric families in one
``prometheus_client`` registry: the engine passes its own registry (vLLM's,
say, or ``prometheus_client.REGISTRY``) or gets a private one.  Several
bridges may share one :class:`BridgeMetrics`; their series are told apart by
the ``bridge`` label (the bridge's identity) and ``model_name``.  The HTTP
endpoint is off unless asked for (``http=(addr, port)`` or
:meth:`BridgeMetrics.start_http_server`).

Names follow the anchors: vLLM's NIXL connector (``vllm:nixl_xfer_time_seconds``,
``vllm:nixl_bytes_transferred``, ``vllm:nixl_num_failed_transfers``,
``vllm:nixl_num_kv_expired_reqs``) for the namespace-colon form and the
transfer families, and NIXL's agent telemetry (``agent_tx_bytes_total``,
``agent_rx_bytes_total``, ``agent_errors_total{status}``) for the byte counters.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..errors import InvalidArgument, KVBridgeError
from .handles import DeliveryStats

__all__ = ["DIRECTIONS", "PATHS", "BridgeMetrics", "BridgeMetricsView"]

PATHS = ("tcp", "ucx-put", "ucx-staging")
DIRECTIONS = ("send", "recv")
# vLLM's NIXL transfer-time buckets (seconds), widened for WAN transfers
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 30.0, 60.0)  # fmt: skip
# 2 KiB to 8 GiB, every factor of 4 (vLLM's bytes_transferred buckets)
BYTE_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
LABELS = ("bridge", "model_name")


class BridgeMetrics:
    """The metric families of kvbridge's bridges, in one registry."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        http: tuple[str, int] | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.tx_bytes = Counter(
            "kvbridge:tx_bytes",
            "KV bytes delivered to receivers (before compression), by path.",
            [*LABELS, "path"],
            registry=r,
        )
        self.tx_wire_bytes = Counter(
            "kvbridge:tx_wire_bytes",
            "Bytes that crossed the network for delivered sends (after compression), by path.",
            [*LABELS, "path"],
            registry=r,
        )
        self.rx_bytes = Counter(
            "kvbridge:rx_bytes",
            "KV bytes received into the cache's pages, by path.",
            [*LABELS, "path"],
            registry=r,
        )
        self.rx_wire_bytes = Counter(
            "kvbridge:rx_wire_bytes",
            "Bytes that crossed the network for completed receives, by path.",
            [*LABELS, "path"],
            registry=r,
        )
        self.xfer_time = Histogram(
            "kvbridge:xfer_time_seconds",
            "Duration of completed transfers, from send (or expect) to the bytes landed.",
            [*LABELS, "direction", "path"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.bytes_transferred = Histogram(
            "kvbridge:bytes_transferred",
            "KV bytes per completed transfer.",
            [*LABELS, "direction", "path"],
            buckets=BYTE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvbridge:retries",
            "Chunks sent again (NACK or a dropped connection) by completed sends.",
            [*LABELS, "path"],
            registry=r,
        )
        self.failed = Counter(
            "kvbridge:num_failed_transfers",
            "Failed transfers, by direction and kvbridge error type. Expired leases are "
            "counted here (error LeaseExpired) and in kvbridge:num_kv_expired_reqs.",
            [*LABELS, "direction", "error"],
            registry=r,
        )
        self.expired = Counter(
            "kvbridge:num_kv_expired_reqs",
            "Requests whose send lease ran out before the transfer finished (aborted at "
            "both ends). Tracked on the sender.",
            list(LABELS),
            registry=r,
        )
        self.active = Gauge(
            "kvbridge:active_transfers",
            "Transfers in progress (one per destination of a send, one per expect).",
            [*LABELS, "direction"],
            registry=r,
        )
        self._lock = threading.Lock()
        self._http: Any = None
        self.http_port: int | None = None
        if http is not None:
            self.start_http_server(http[1], http[0])

    def for_bridge(self, identity: str, model_name: str = "") -> BridgeMetricsView:
        """The series of one bridge."""
        return BridgeMetricsView(self, identity, model_name)

    # ---- the endpoint ---------------------------------------------------------------
    def start_http_server(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` for this registry (``prometheus_client.start_http_server``
        in a daemon thread); returns the bound port (``port=0``: any free one)."""
        with self._lock:
            if self._http is not None:
                raise InvalidArgument(f"metrics are already served on port {self.http_port}")
            try:
                server, _thread = start_http_server(port, addr, registry=self.registry)
            except OSError as e:
                raise InvalidArgument(f"cannot serve metrics on {addr}:{port}: {e}") from e
            self._http = server
            self.http_port = int(server.server_address[1])
            return self.http_port

    def close(self) -> None:
        """Stop the HTTP endpoint (if started); the metrics stay readable."""
        with self._lock:
            server, self._http = self._http, None
            self.http_port = None
        if server is not None:
            server.shutdown()
            server.server_close()


class BridgeMetricsView:
    """One bridge's series of a :class:`BridgeMetrics`: what the bridges call."""

    def __init__(self, metrics: BridgeMetrics, identity: str, model_name: str) -> None:
        self.metrics = metrics
        self.labels = (identity, model_name)
        for d in DIRECTIONS:  # present (at 0) from the start, so a scrape sees them
            metrics.active.labels(*self.labels, d)
        metrics.expired.labels(*self.labels)

    def started(self, direction: str) -> None:
        self.metrics.active.labels(*self.labels, direction).inc()

    def finished(self, direction: str, stats: DeliveryStats) -> None:
        m, lab = self.metrics, self.labels
        m.active.labels(*lab, direction).dec()
        path = stats.path
        if direction == "send":
            m.tx_bytes.labels(*lab, path).inc(stats.bytes)
            m.tx_wire_bytes.labels(*lab, path).inc(stats.wire_bytes)
            m.retries.labels(*lab, path).inc(stats.retries)
        else:
            m.rx_bytes.labels(*lab, path).inc(stats.bytes)
            m.rx_wire_bytes.labels(*lab, path).inc(stats.wire_bytes)
        m.xfer_time.labels(*lab, direction, path).observe(stats.seconds)
        m.bytes_transferred.labels(*lab, direction, path).observe(stats.bytes)

    def failed(self, direction: str, error: KVBridgeError) -> None:
        m = self.metrics
        m.active.labels(*self.labels, direction).dec()
        m.failed.labels(*self.labels, direction, type(error).__name__).inc()

    def lease_expired(self) -> None:
        self.metrics.expired.labels(*self.labels).inc()
