"""The disaggregation proxy's own state, bounded: the last ``window``
request records (``GET /stats``) plus running totals, and its Prometheus
series (``GET /metrics``).  No IO: the proxy feeds finished records in.

Series names follow vLLM's own conventions (a namespace, a colon, snake
case, ``_total`` counters, ``_seconds`` histograms with vLLM's TTFT
buckets) under a namespace of the proxy's own, ``kvbridge_proxy:``:
``vllm:`` is vLLM's (an engine's /metrics carries ``vllm:*`` and the
connector's ``vllm:kvbridge_*``), ``kvbridge:`` is the bridge's; the proxy
is a third process in front of them, and a dashboard that scrapes all three
sees at a glance which process a series comes from.

=============================================  =========  ======================
series                                          type       labels
=============================================  =========  ======================
kvbridge_proxy:requests_total                   counter    pipeline, outcome
kvbridge_proxy:pipeline_decisions_total         counter    pipeline
kvbridge_proxy:time_to_first_token_seconds      histogram  pipeline
kvbridge_proxy:switch_gap_seconds               histogram  (P-RLD-MD: the longest
                                                           pause around the switch)
kvbridge_proxy:generation_tokens_total          counter    source (relay, main)
kvbridge_proxy:relay_share                      gauge      (relay / all tokens)
kvbridge_proxy:requests_running                 gauge
=============================================  =========  ======================
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ...errors import InvalidArgument

__all__ = ["CONTENT_TYPE_LATEST", "TTFT_BUCKETS", "ProxyStats"]

NS = "kvbridge_proxy:"
# vLLM's buckets for vllm:time_to_first_token_seconds (v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
GAP_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ProxyStats:
    """The last ``window`` records and totals since the last reset; the
    Prometheus series count from the start, as counters must."""

    def __init__(self, window: int = 1024, registry: CollectorRegistry | None = None) -> None:
        if not isinstance(window, int) or window < 1:
            raise InvalidArgument(f"window must be an int >= 1, got {window!r}")
        self.window: deque[Any] = deque(maxlen=window)
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.m_requests = Counter(
            NS + "requests", "Requests the proxy finished", ["pipeline", "outcome"], registry=r
        )
        self.m_decisions = Counter(
            NS + "pipeline_decisions", "The router's pipeline per request", ["pipeline"], registry=r
        )
        self.m_ttft = Histogram(
            NS + "time_to_first_token_seconds",
            "Time from the request to its first token, at the proxy",
            ["pipeline"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.m_gap = Histogram(
            NS + "switch_gap_seconds",
            "P-RLD-MD: the longest pause between tokens around the relay-to-main switch",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        self.m_tokens = Counter(
            NS + "generation_tokens", "Tokens streamed to clients", ["source"], registry=r
        )
        self.m_share = Gauge(
            NS + "relay_share", "The relay's share of all streamed tokens", registry=r
        )
        self.m_running = Gauge(NS + "requests_running", "Requests in flight", registry=r)
        self._all_relay = 0
        self._all_main = 0
        self.reset()

    def reset(self) -> None:
        """Forget the window and the totals (not the Prometheus counters)."""
        self.window.clear()
        self.requests = 0
        self.errors = 0
        self.relay_tokens = 0
        self.main_tokens = 0
        self.pipelines: dict[str, int] = {}

    def started(self, pipeline: str) -> None:
        self.m_decisions.labels(pipeline).inc()
        self.m_running.inc()

    def finished(self, rec: Any) -> None:
        """One request ended (``rec`` a proxy RequestRecord)."""
        self.m_running.dec()
        self.window.append(rec)
        self.requests += 1
        self.pipelines[rec.pipeline] = self.pipelines.get(rec.pipeline, 0) + 1
        outcome = "error" if rec.error else "ok"
        if rec.error:
            self.errors += 1
        self.m_requests.labels(rec.pipeline, outcome).inc()
        if rec.ttft_s is not None:
            self.m_ttft.labels(rec.pipeline).observe(rec.ttft_s)
        gap = getattr(rec, "switch_gap_s", None)
        if gap is None:
            gap = rec.handoff_s
        if gap is not None:
            self.m_gap.observe(gap)
        self.relay_tokens += rec.relay_tokens
        self.main_tokens += rec.main_tokens
        self.m_tokens.labels("relay").inc(rec.relay_tokens)
        self.m_tokens.labels("main").inc(rec.main_tokens)
        self._all_relay += rec.relay_tokens
        self._all_main += rec.main_tokens
        total = self._all_relay + self._all_main
        self.m_share.set(self._all_relay / total if total else 0.0)

    def summary(self) -> dict[str, Any]:
        """``GET /stats``: the window's records and the totals since the reset."""
        total = self.relay_tokens + self.main_tokens
        return {
            "requests": [asdict(r) for r in self.window],
            "window": self.window.maxlen,
            "requests_total": self.requests,
            "errors_total": self.errors,
            "relay_tokens": self.relay_tokens,
            "main_tokens": self.main_tokens,
            "relay_share": self.relay_tokens / total if total else 0.0,
            "finished_pipelines": dict(self.pipelines),
        }

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
