"""The connector's transfer statistics in vLLM's terms: ``KVConnectorStats``
(logged as "KV Transfer metrics") and Prometheus series on vLLM's own
``/metrics`` endpoint, named like vLLM's NIXL connector's (docs/vllm.md)::

    vllm:kvbridge_bytes_sent_total, vllm:kvbridge_bytes_received_total
    vllm:kvbridge_wire_bytes_sent_total, vllm:kvbridge_wire_bytes_received_total
    vllm:kvbridge_transfers_total{direction="send"|"recv"}
    vllm:kvbridge_layerwise_sends_total
    vllm:kvbridge_failed_transfers_total{error="recv:TransferTimeout", ...}
    vllm:kvbridge_num_kv_expired_reqs_total
    vllm:kvbridge_xfer_time_seconds{direction}      (histogram)
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from .worker import TransferCounters

__all__ = ["KVBridgePromMetrics", "KVBridgeStats"]

_INTS = (
    "bytes_sent",
    "bytes_received",
    "wire_bytes_sent",
    "wire_bytes_received",
    "sends",
    "receives",
    "layerwise_sends",
    "expired_leases",
)
_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def _empty() -> dict[str, Any]:
    d: dict[str, Any] = {k: 0 for k in _INTS}
    d.update(send_seconds=[], recv_seconds=[], failures={})
    return d


class KVBridgeStats(KVConnectorStats):  # type: ignore[misc]
    """Counters since the last interval, summed over workers."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data: dict[str, Any] = _empty()

    @classmethod
    def of(cls, c: TransferCounters) -> KVBridgeStats:
        return cls(data=asdict(c))

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        o = other.data
        for k in _INTS:
            self.data[k] = self.data.get(k, 0) + int(o.get(k, 0))
        for k in ("send_seconds", "recv_seconds"):
            self.data[k] = list(self.data.get(k, [])) + list(o.get(k, []))
        f = dict(self.data.get("failures", {}))
        for kind, n in dict(o.get("failures", {})).items():
            f[kind] = f.get(kind, 0) + int(n)
        self.data["failures"] = f
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "Sends": d["sends"],
            "Receives": d["receives"],
            "Layer-wise sends": d["layerwise_sends"],
            "MB sent": round(d["bytes_sent"] / 1e6, 3),
            "MB received": round(d["bytes_received"] / 1e6, 3),
            "Expired leases": d["expired_leases"],
        }
        for k, label in (("send_seconds", "send"), ("recv_seconds", "receive")):
            xs = d.get(k) or []
            if xs:
                out[f"Avg {label} time (ms)"] = round(1e3 * sum(xs) / len(xs), 3)
        for kind, n in sorted(d.get("failures", {}).items()):
            out[f"Failed {kind}"] = n
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not any(
            d.get(k) for k in ("sends", "receives", "layerwise_sends", "failures", "expired_leases")
        )


class KVBridgePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._values = per_engine_labelvalues

        def counter(name: str, doc: str) -> dict[int, Any]:
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            per_engine: dict[int, Any] = create_metric_per_engine(c, per_engine_labelvalues)
            return per_engine

        self.bytes = {
            k: counter(f"vllm:kvbridge_{k}", f"KV bytes ({k.replace('_', ' ')}) by kvbridge.")
            for k in ("bytes_sent", "bytes_received", "wire_bytes_sent", "wire_bytes_received")
        }
        self.layerwise = counter(
            "vllm:kvbridge_layerwise_sends",
            "Sends that started before the prompt's KV was complete.",
        )
        self.expired = counter(
            "vllm:kvbridge_num_kv_expired_reqs",
            "Sends whose lease on the prefill's blocks ran out.",
        )
        self.transfers = self._counter_cls(
            name="vllm:kvbridge_transfers",
            documentation="Completed kvbridge transfers, by direction.",
            labelnames=[*labelnames, "direction"],
        )
        self.failed = self._counter_cls(
            name="vllm:kvbridge_failed_transfers",
            documentation="Failed kvbridge transfers, by direction and error type.",
            labelnames=[*labelnames, "error"],
        )
        self.xfer_time = self._histogram_cls(
            name="vllm:kvbridge_xfer_time_seconds",
            documentation="Duration of kvbridge KV transfers, by direction.",
            buckets=_BUCKETS,
            labelnames=[*labelnames, "direction"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        base = list(self._values.get(engine_idx, []))
        for k, m in self.bytes.items():
            if d.get(k):
                m[engine_idx].inc(d[k])
        if d.get("layerwise_sends"):
            self.layerwise[engine_idx].inc(d["layerwise_sends"])
        if d.get("expired_leases"):
            self.expired[engine_idx].inc(d["expired_leases"])
        for direction, n, secs in (
            ("send", d.get("sends", 0), d.get("send_seconds", [])),
            ("recv", d.get("receives", 0), d.get("recv_seconds", [])),
        ):
            if n:
                self.transfers.labels(*base, direction).inc(n)
            for s in secs:
                self.xfer_time.labels(*base, direction).observe(s)
        for kind, n in d.get("failures", {}).items():
            self.failed.labels(*base, kind).inc(n)
