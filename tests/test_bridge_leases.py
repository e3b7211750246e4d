"""Request leases on the sender: a send pins its request's pages until every
destination has finished, failed or the lease ran out (default 30 s,
renewable); an expired lease aborts the send at both ends with a typed
error.  Driven by a fake clock wherever the clock matters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.bridge import DecodeBridge, LeaseTable, PeerConfig, PrefillBridge
from kvbridge.bridge.metrics import BridgeMetrics
from kvbridge.errors import InvalidArgument, LeaseExpired, TransferAborted, TransferTimeout
from kvbridge.layout import KVLayout

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


# ---- the table alone ----------------------------------------------------------------------
def test_lease_table_grant_renew_release_expire() -> None:
    clock = FakeClock()
    t = LeaseTable(30.0, clock)
    a = t.grant("a")
    b = t.grant("b", 5)
    assert (a.deadline, b.deadline) == (1030.0, 1005.0)
    assert t.next_deadline == 1005.0
    with pytest.raises(InvalidArgument, match="already holds"):
        t.grant("a")
    clock.advance(4)
    assert t.pop_expired() == []
    assert t.renew("b") is b and b.deadline == 1009.0 and b.renewals == 1
    clock.advance(4.5)
    assert t.pop_expired() == []  # renewed: the old deadline no longer counts
    assert t.renew("b", 1.0) is b and b.seconds == 1.0  # a new length from now on
    clock.advance(1.0)
    assert [x.request_id for x in t.pop_expired()] == ["b"]
    assert "b" not in t and t.renew("b") is None  # gone: nothing left to renew
    assert t.release("a") is a and t.release("a") is None
    assert t.next_deadline is None and len(t) == 0


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "5", True])
def test_lease_lengths_are_finite_positive_seconds(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        LeaseTable(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        LeaseTable().grant("x", bad)  # type: ignore[arg-type]


def test_many_leases_expire_in_deadline_order() -> None:
    clock = FakeClock()
    t = LeaseTable(10.0, clock)
    rng = np.random.default_rng(0)
    lengths = {f"r{i}": float(rng.integers(1, 100)) for i in range(200)}
    for rid, s in lengths.items():
        t.grant(rid, s)
    for rid in list(lengths)[::3]:
        t.renew(rid, lengths[rid] + 50)
        lengths[rid] += 50
    seen = []
    for step in range(1, 160):
        clock.t = 1000.0 + step
        for lease in t.pop_expired():
            assert lease.deadline <= clock.t
            seen.append(lease.request_id)
    assert sorted(seen) == sorted(lengths) and len(seen) == len(set(seen))


# ---- in the asyncio PrefillBridge ---------------------------------------------------------------
async def _pair(clock: FakeClock | None = None, **kw: object) -> tuple[PrefillBridge, DecodeBridge]:
    src = pack.PagedKVCache.allocate(P, 64, fill="random", seed=1)
    md = await DecodeBridge(pack.PagedKVCache.allocate(P, 64), identity="md",
                            tcp_listen=("127.0.0.1", 0)).start()  # fmt: skip
    pre = PrefillBridge(src, identity="p", clock=clock or FakeClock(), **kw)  # type: ignore[arg-type]
    await pre.connect("md", PeerConfig("tcp", *md.tcp_address, streams=2))
    return pre, md


def test_an_expired_lease_aborts_the_send_at_both_ends() -> None:
    async def main() -> None:
        clock = FakeClock()
        metrics = BridgeMetrics()
        pre, md = await _pair(clock, lease_timeout=5.0, metrics=metrics)
        try:
            e = md.expect("r", list(range(20)), 0, 300, timeout=60)
            lw = pre.send_layerwise("r", list(range(20)), {"md": e.ticket})  # held: no layer
            await asyncio.sleep(0.1)
            clock.advance(4.0)
            assert pre.expire_leases() == []
            assert pre.renew_lease("r") is True  # 5 s from now again
            clock.advance(4.0)
            assert pre.expire_leases() == [] and "r" in pre.live_sends
            clock.advance(1.5)
            assert pre.expire_leases() == ["r"]
            with pytest.raises(LeaseExpired, match=r"request 'r' ran out \(5 s, renewed 1 times\)"):
                await lw.wait(5)
            with pytest.raises(TransferAborted, match="lease") as info:
                await e.wait(5)  # the receiver is told at once, not after its own deadline
            assert info.value.code == 9
            assert not pre.live_sends and len(pre.leases) == 0 and pre.renew_lease("r") is False
            val = metrics.registry.get_sample_value
            assert val("kvbridge:num_kv_expired_reqs_total", {"bridge": "p", "model_name": ""}) == 1
            failed = {"bridge": "p", "model_name": "", "direction": "send", "error": "LeaseExpired"}
            assert val("kvbridge:num_failed_transfers_total", failed) == 1
        finally:
            await pre.close()
            await md.close()

    arun(main())


def test_a_finished_send_releases_its_lease_and_the_request_may_be_sent_again() -> None:
    async def main() -> None:
        pre, md = await _pair()
        try:
            e = md.expect("r", list(range(20)), 0, 300)
            ms = pre.send("r", list(range(20)), {"md": e.ticket}, lease=120)
            assert pre.leases.get("r") is not None and pre.leases.get("r").seconds == 120  # type: ignore[union-attr]
            with pytest.raises(InvalidArgument, match="being sent already"):
                pre.send("r", list(range(20)), {"md": e.ticket})
            released: list[str] = []
            ms.on_done(lambda g: released.append(g.request_id))
            await ms.wait(20)
            await asyncio.sleep(0)
            assert released == ["r"] and not pre.live_sends and len(pre.leases) == 0
            assert pre._lease_timer is None  # nothing left to time
            again = pre.send("r", list(range(20)), {"md": e.ticket})  # completes at once (replay)
            await again.wait(20)
        finally:
            await pre.close()
            await md.close()

    arun(main())


def test_the_lease_timer_fires_by_itself() -> None:
    async def main() -> None:
        import time

        pre, md = await _pair(clock=time.monotonic, lease_timeout=0.3)  # type: ignore[arg-type]
        try:
            e = md.expect("r", list(range(20)), 0, 300, timeout=60)
            t0 = time.monotonic()
            lw = pre.send_layerwise("r", list(range(20)), {"md": e.ticket})
            with pytest.raises(LeaseExpired):
                await lw.wait(10)
            assert 0.25 < time.monotonic() - t0 < 3.0
            with pytest.raises(TransferAborted):
                await e.wait(5)
        finally:
            await pre.close()
            await md.close()

    arun(main())


def test_a_failed_send_releases_its_lease() -> None:
    async def main() -> None:
        pre, md = await _pair()
        try:
            e = md.expect("r", list(range(20)), 0, 300, timeout=0.2)
            lw = pre.send_layerwise("r", list(range(20)), {"md": e.ticket})  # the receiver gives up
            with pytest.raises((TransferAborted, TransferTimeout)):
                await lw.wait(10)
            await asyncio.sleep(0)
            assert not pre.live_sends and len(pre.leases) == 0
            t0 = asyncio.get_running_loop().time()
            await pre.close()  # no pack is left waiting for layers that will never come
            assert asyncio.get_running_loop().time() - t0 < 5
        finally:
            await pre.close()
            await md.close()

    arun(main())


def test_an_expired_lease_tells_a_ucx_receiver_even_before_any_layer_left() -> None:
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(f"UCX unavailable: {ucx.unavailable_reason()}")

    async def main() -> None:
        clock = FakeClock()
        rld = await DecodeBridge(pack.PagedKVCache.allocate(P, 64), identity="rld",
                                 ucx=True).start()  # fmt: skip
        pre = PrefillBridge(pack.PagedKVCache.allocate(P, 64, fill="random", seed=2),
                            identity="p", clock=clock, lease_timeout=5)  # fmt: skip
        try:
            await pre.connect("rld", PeerConfig("ucx", metadata=rld.ucx_metadata()))
            e1 = rld.expect("a", list(range(20)), 0, 300, via="ucx", timeout=60)
            e2 = rld.expect("b", list(range(20, 40)), 0, 300, via="ucx", timeout=60)
            lw1 = pre.send_layerwise("a", list(range(20)), {"rld": e1.ticket})  # nothing left
            lw2 = pre.send_layerwise("b", list(range(20)), {"rld": e2.ticket})
            lw2.layers_ready(2)  # half of it landed
            await asyncio.sleep(0.2)
            clock.advance(6)
            assert sorted(pre.expire_leases()) == ["a", "b"]
            for lw, e in ((lw1, e1), (lw2, e2)):
                with pytest.raises(LeaseExpired):
                    await lw.wait(5)
                with pytest.raises(TransferAborted, match="lease"):
                    await e.wait(5)
        finally:
            await pre.close()
            await rld.close()

    arun(main(), timeout=60)
