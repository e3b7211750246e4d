"""The fleet demo in its reduced smoke mode (what ``make demo-fleet`` runs,
with the random model and few requests): a real etcd, 2 prefills, 1 relay,
2 main decodes as processes of their own, the driver's FleetRouter fed by an
etcd watch.  It checks its own run: the main decode killed halfway had a
request on it and left the view when its lease expired; every request on it
either continued on another main decode (the client's stream carrying every
token once, in order) or ended without it; the new main decode joined; every
stream equals the reference engine decoding the request alone."""

from __future__ import annotations

import asyncio
import math

import pytest
from etcd_server import etcd_binary

pytest.importorskip("kvbridge._core")

from kvbridge_bench.demo.fleet import fleet_config, run_fleet_demo


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fleet_demo_smoke() -> None:
    etcd_binary()  # skips (or fails under CI=true) without an etcd server binary
    lines: list[str] = []
    res = asyncio.run(
        asyncio.wait_for(run_fleet_demo(fleet_config(smoke=True), log=lines.append), 380)
    )
    text = "\n".join(lines)
    assert res.ok, text
    assert len(res.records) == 12 and all(r.tokens for r in res.records), text
    assert res.victim and res.hit_by_kill, text  # the victim had a request in flight
    assert math.isfinite(res.gone_t) and res.gone_t >= res.kill_t, text
    assert res.joined and math.isfinite(res.join_t) and res.join_t >= res.gone_t, text
    assert {"p-0", "p-1", "rld-0", "md-0", "md-1", res.joined} <= set(res.roles), text
    for r in res.records:
        fo = r.detail.get("failover")
        if fo is not None:  # continued elsewhere: the stream is the reference's, in order
            assert fo["to"] != res.victim and r.check in ("exact", "near-tie"), text
    on_victim = [r for r in res.records if r.request_id in set(res.hit_by_kill)]
    assert on_victim and all(not r.error for r in on_victim), text
    assert any("streams: 12/12 equal the reference" in line for line in lines), text
