"""Prometheus metrics of the bridges, scraped from the real HTTP endpoint on
loopback: bytes and wire bytes by path, latency histograms, retries,
failures by error type, expired leases, active transfers; a registry the
engine passes in; the endpoint off unless asked for."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.bridge import BridgeMetrics, PeerConfig, SyncBridge
from kvbridge.bridge.sync import BridgeEvents
from kvbridge.errors import InvalidArgument
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)
NAMES = {
    "kvbridge:tx_bytes_total",
    "kvbridge:tx_wire_bytes_total",
    "kvbridge:rx_bytes_total",
    "kvbridge:rx_wire_bytes_total",
    "kvbridge:xfer_time_seconds_bucket",
    "kvbridge:xfer_time_seconds_count",
    "kvbridge:xfer_time_seconds_sum",
    "kvbridge:bytes_transferred_count",
    "kvbridge:retries_total",
    "kvbridge:num_failed_transfers_total",
    "kvbridge:num_kv_expired_reqs_total",
    "kvbridge:active_transfers",
}


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(m: dict[Any, float], name: str, **labels: str) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def wait_for(b: SyncBridge, done: Callable[[BridgeEvents], bool], timeout: float = 20) -> None:
    ev = BridgeEvents()
    deadline = time.monotonic() + timeout
    while not done(ev):
        e = b.poll()
        ev.sent += e.sent
        ev.received += e.received
        ev.failed += e.failed
        ev.released += e.released
        assert time.monotonic() < deadline, ev
        time.sleep(0.005)


def test_the_endpoint_reports_every_family_by_bridge_and_path() -> None:
    metrics = BridgeMetrics(http=("127.0.0.1", 0))
    port = metrics.http_port
    assert port
    src = pack.PagedKVCache.allocate(P, 64)  # zeros: compressible, so wire bytes < bytes
    dst = pack.PagedKVCache.allocate(P.replace(page_tokens=32), 32)
    try:
        with (
            SyncBridge(dst, identity="md", model_id="m", tcp_listen=("127.0.0.1", 0),
                       metrics=metrics) as md,
            SyncBridge(src, identity="p", model_id="m", metrics=metrics) as pre,
        ):  # fmt: skip
            pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port, compression="lz4"))
            n = 500
            for i in range(3):
                t = md.expect(f"r{i}", list(range(P.replace(page_tokens=32).pages_for(n))), 0, n)
                pre.send(f"r{i}", list(range(P.pages_for(n))), {"md": t})
            wait_for(pre, lambda e: len(e.released) == 3)
            wait_for(md, lambda e: len(e.received) == 3)
            t = md.expect("held", list(range(16)), 0, n)
            pre.send("held", list(range(32)), {"md": t}, layerwise=True, lease=0.3)
            time.sleep(0.05)
            m = scrape(port)
            assert NAMES - {"kvbridge:num_failed_transfers_total"} <= {name for name, _ in m}
            p, d = {"bridge": "p", "model_name": "m"}, {"bridge": "md", "model_name": "m"}
            assert val(m, "kvbridge:active_transfers", **p, direction="send") == 1
            assert val(m, "kvbridge:active_transfers", **d, direction="recv") == 1
            wait_for(pre, lambda e: len(e.failed) == 1)
            wait_for(md, lambda e: len(e.failed) == 1)
            m = scrape(port)
            assert {name for name, _ in m} >= NAMES  # a failure family appears with its first
            nbytes = 3 * P.wire_nbytes(n)
            assert val(m, "kvbridge:tx_bytes_total", **p, path="tcp") == nbytes
            assert val(m, "kvbridge:rx_bytes_total", **d, path="tcp") == nbytes
            assert 0 < val(m, "kvbridge:tx_wire_bytes_total", **p, path="tcp") < nbytes / 10
            assert (
                val(m, "kvbridge:xfer_time_seconds_count", **p, direction="send", path="tcp") == 3
            )
            assert (
                val(m, "kvbridge:xfer_time_seconds_count", **d, direction="recv", path="tcp") == 3
            )
            assert val(m, "kvbridge:xfer_time_seconds_sum", **p, direction="send", path="tcp") > 0
            inf = val(m, "kvbridge:xfer_time_seconds_bucket", **p, direction="send", path="tcp",
                      le="+Inf")  # fmt: skip
            assert inf == 3
            assert (
                val(m, "kvbridge:bytes_transferred_sum", **p, direction="send", path="tcp")
                == nbytes
            )
            assert val(m, "kvbridge:retries_total", **p, path="tcp") == 0
            assert val(m, "kvbridge:num_kv_expired_reqs_total", **p) == 1
            assert val(m, "kvbridge:num_failed_transfers_total", **p, direction="send",
                       error="LeaseExpired") == 1  # fmt: skip
            assert val(m, "kvbridge:num_failed_transfers_total", **d, direction="recv",
                       error="TransferAborted") == 1  # fmt: skip
            assert val(m, "kvbridge:active_transfers", **p, direction="send") == 0
            assert val(m, "kvbridge:active_transfers", **d, direction="recv") == 0
    finally:
        metrics.close()
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # the endpoint is gone


@pytest.mark.skipif(not ucx.available(), reason="UCX unavailable")
def test_the_ucx_paths_are_labelled_put_and_staging() -> None:
    metrics = BridgeMetrics(http=("127.0.0.1", 0))
    src = pack.PagedKVCache.allocate(P, 64, fill="random", seed=1)
    try:
        with (
            SyncBridge(pack.PagedKVCache.allocate(P, 64), identity="same", ucx=True,
                       metrics=metrics) as same,
            SyncBridge(pack.PagedKVCache.allocate(P.replace(page_tokens=64), 16),
                       identity="other", ucx=True, metrics=metrics) as other,
            SyncBridge(src, identity="p", metrics=metrics) as pre,
        ):  # fmt: skip
            pre.connect("same", PeerConfig("ucx", metadata=same.ucx_metadata()))
            pre.connect("other", PeerConfig("ucx", metadata=other.ucx_metadata()))
            n = 300
            pre.send("r", list(range(P.pages_for(n))), {
                "same": same.expect("r", list(range(P.pages_for(n))), 0, n, via="ucx"),
                "other": other.expect("r", list(range(5)), 0, n, via="ucx"),
            })  # fmt: skip
            wait_for(pre, lambda e: len(e.released) == 1)
            wait_for(same, lambda e: len(e.received) == 1)
            wait_for(other, lambda e: len(e.received) == 1)
            m = scrape(metrics.http_port or 0)
            lab = {"bridge": "p", "model_name": ""}
            assert val(m, "kvbridge:tx_bytes_total", **lab, path="ucx-put") == P.wire_nbytes(n)
            assert val(m, "kvbridge:tx_bytes_total", **lab, path="ucx-staging") == P.wire_nbytes(n)
            assert val(m, "kvbridge:rx_bytes_total", bridge="other", model_name="",
                       path="ucx-staging") == P.wire_nbytes(n)  # fmt: skip
    finally:
        metrics.close()


def test_a_registry_the_engine_passes_in_and_private_ones() -> None:
    reg = CollectorRegistry()
    metrics = BridgeMetrics(reg)
    assert metrics.http_port is None  # no endpoint unless asked for
    with SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="a", metrics=metrics) as a:
        assert a.metrics is metrics
        text = generate_latest(reg).decode()
        assert 'kvbridge:active_transfers{bridge="a",direction="send",model_name=""} 0.0' in text
    with pytest.raises(ValueError, match="Duplicated"):
        BridgeMetrics(reg)  # one BridgeMetrics per registry; bridges share it
    # bridges without metrics get a private registry each: no collision
    with (
        SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="x") as x,
        SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="x") as y,
    ):
        assert x.metrics.registry is not y.metrics.registry


def test_the_endpoint_is_served_from_its_own_thread_and_refuses_a_second_start() -> None:
    metrics = BridgeMetrics()
    metrics.for_bridge("x")  # a bridge's series exist (at 0) from its start
    port = metrics.start_http_server(0)
    try:
        with pytest.raises(InvalidArgument, match="already"):
            metrics.start_http_server(0)
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(len(scrape(port)))) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(results) == 4 and all(results)
    finally:
        metrics.close()
    metrics.close()  # idempotent
