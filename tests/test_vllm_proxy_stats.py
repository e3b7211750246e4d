"""The proxy's own state is bounded (the last ``stats_window`` records plus
totals) and its Prometheus series are well-formed, in vLLM's conventions
under the ``kvbridge_proxy:`` namespace; ``GET /metrics`` and ``GET /stats``
served by the proxy's aiohttp app on a real socket."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.integrations.vllm.proxy_stats import ProxyStats


@dataclass
class Rec:
    """The fields of the proxy's RequestRecord that ProxyStats reads (the
    proxy module needs aiohttp, which the plain suite lacks)."""

    transfer_id: str
    pipeline: str
    relay_tokens: int = 0
    main_tokens: int = 0
    ttft_s: float | None = None
    handoff_s: float | None = None
    switch_gap_s: float | None = None
    error: str | None = None


def _rec(i: int, pipeline: str = "P-MD", **kw: object) -> Rec:
    r = Rec(f"t{i}", pipeline)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_window_is_bounded_and_totals_count_everything() -> None:
    st = ProxyStats(window=8)
    for i in range(1000):
        st.started("P-MD")
        st.finished(_rec(i, main_tokens=3, ttft_s=0.05))
    assert len(st.window) == 8
    assert [r.transfer_id for r in st.window] == [f"t{i}" for i in range(992, 1000)]
    s = st.summary()
    assert s["requests_total"] == 1000 and s["main_tokens"] == 3000
    assert len(s["requests"]) == 8 and s["window"] == 8
    st.reset()
    assert st.summary()["requests_total"] == 0 and not st.window
    m = _samples(st.exposition().decode())
    # counters count from the start, whatever the resets
    assert m[("kvbridge_proxy:requests_total", (("outcome", "ok"), ("pipeline", "P-MD")))] == 1000
    assert m[("kvbridge_proxy:time_to_first_token_seconds_count", (("pipeline", "P-MD"),))] == 1000
    assert m[("kvbridge_proxy:requests_running", ())] == 0


def test_series_names_labels_and_relay_share() -> None:
    st = ProxyStats(window=4)
    st.started("P-RLD-MD")
    st.finished(_rec(1, "P-RLD-MD", relay_tokens=3, main_tokens=9, ttft_s=0.2, switch_gap_s=0.03))
    st.started("P-MD")
    st.finished(_rec(2, error="prefill: boom", ttft_s=None))
    m = _samples(st.exposition().decode())
    assert m[("kvbridge_proxy:generation_tokens_total", (("source", "relay"),))] == 3
    assert m[("kvbridge_proxy:generation_tokens_total", (("source", "main"),))] == 9
    assert m[("kvbridge_proxy:relay_share", ())] == pytest.approx(0.25)
    assert m[("kvbridge_proxy:switch_gap_seconds_count", ())] == 1
    assert m[("kvbridge_proxy:switch_gap_seconds_bucket", (("le", "0.04"),))] == 1
    assert m[("kvbridge_proxy:requests_total", (("outcome", "error"), ("pipeline", "P-MD")))] == 1
    assert m[("kvbridge_proxy:pipeline_decisions_total", (("pipeline", "P-RLD-MD"),))] == 1
    assert all(name.startswith("kvbridge_proxy:") for name, _ in m)
    s = st.summary()
    assert s["errors_total"] == 1 and s["relay_share"] == pytest.approx(0.25)


def test_proxy_serves_metrics_and_stats() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    from kvbridge.integrations.vllm.proxy import Backend, DisaggProxy, ProxyConfig

    async def run() -> tuple[str, dict[str, object]]:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        cfg = ProxyConfig(
            prefill=Backend("prefill-0", "http://127.0.0.1:9"),
            main=Backend("md", "http://127.0.0.1:9"),
            stats_window=2,
        )
        proxy = DisaggProxy(cfg)
        for i in range(5):
            proxy.stats.started("P-MD")
            proxy.stats.finished(_rec(i, main_tokens=2))
        runner = aiohttp.web.AppRunner(proxy.app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/plain")
                    text = await r.text()
                async with s.get(f"http://127.0.0.1:{port}/stats") as r:
                    stats = await r.json()
        finally:
            await runner.cleanup()
        return text, stats

    text, stats = asyncio.run(run())
    m = _samples(text)
    assert m[("kvbridge_proxy:requests_total", (("outcome", "ok"), ("pipeline", "P-MD")))] == 5
    assert stats["requests_total"] == 5 and len(stats["requests"]) == 2  # type: ignore[arg-type]
    assert stats["main_tokens"] == 10
