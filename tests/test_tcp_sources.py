"""One live source per transfer (docs/protocol.md 5.1, issue 28 item 1), over
real sockets: two TcpSenders whose KV differs, one ticket, one TcpReceiver.
The second sender's OPEN is refused with SourceConflict, the first one
completes, and the decode's pages are exactly the first sender's KV (they
were once stitched from both, and all three parties reported success).  A
sender whose connections are gone is taken over; the same sender resumes
after losing its connection; tensor-parallel ranks of disjoint head ranges
do not conflict, two senders of one head range do."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from tcp_support import FaultProxy, arun

from kvbridge.errors import KVBridgeError, SourceConflict
from kvbridge.layout import KVLayout
from kvbridge.transport.tcp import KVSink, KVSource, TcpReceiver, TcpSender

pytest.importorskip("kvbridge._core")
from kvbridge import pack

SRC = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype="fp16", page_tokens=16)
DST = SRC.replace(page_tokens=32, order="page_first")
N = 256  # tokens: 2 MiB of wire
PAGES = SRC.pages_for(N)


def _digest(cache: Any, table: np.ndarray, heads: tuple[int, int] | None = None) -> str:
    return hashlib.sha256(bytes(np.asarray(pack.pack(cache, table, 0, N, heads=heads)))).hexdigest()


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.002)


def _sender(port: int, **kw: Any) -> TcpSender:
    kw.setdefault("streams", 2)
    kw.setdefault("chunk_size", 128 << 10)
    return TcpSender("127.0.0.1", port, compat_hash=SRC.compat_hash, compression="off", **kw)


def test_a_second_live_sender_is_refused_at_open_and_the_first_ones_kv_lands() -> None:
    """20 rounds.  Even rounds: A's OPEN is taken, then B sends (a re-routed
    request whose first prefill still sends).  Odd rounds: both start at
    once; whichever OPEN the receiver takes first wins, the other is
    refused.  Every round: the loser's handle raises SourceConflict, the
    winner's and the decode's complete, and the decode's pages hash equal
    to the winner's KV, never a mix."""
    src_a = pack.PagedKVCache.allocate(SRC, PAGES, fill="random", seed=1)
    src_b = pack.PagedKVCache.allocate(SRC, PAGES, fill="random", seed=2)
    table = np.arange(PAGES, dtype=np.int32)
    want = {"a": _digest(src_a, table), "b": _digest(src_b, table)}
    assert want["a"] != want["b"]

    async def main() -> None:
        rx = await TcpReceiver(compat_hash=DST.compat_hash).start()
        tx = {"a": await _sender(rx.port).connect(), "b": await _sender(rx.port).connect()}
        src = {"a": src_a, "b": src_b}
        try:
            for i in range(20):
                dst = pack.PagedKVCache.allocate(DST, DST.pages_for(N))
                dtable = np.arange(DST.pages_for(N), dtype=np.int32)[::-1].copy()
                h = rx.expect(f"r{i}", KVSink(dst, dtable, 0, N, None), timeout=30)
                t = h._transfer
                sends = {}
                if i % 2 == 0:
                    sends["a"] = tx["a"].send(
                        f"r{i}", KVSource(src_a, table, 0, N, None), token=h.token
                    )
                    await _until(lambda t=t: t.bound)
                    sends["b"] = tx["b"].send(
                        f"r{i}", KVSource(src_b, table, 0, N, None), token=h.token
                    )
                else:
                    for k in ("b", "a"):
                        sends[k] = tx[k].send(
                            f"r{i}", KVSource(src[k], table, 0, N, None), token=h.token
                        )
                results: dict[str, BaseException | None] = {}
                for k, s in sends.items():
                    try:
                        await s.wait(30)
                        results[k] = None
                    except KVBridgeError as e:
                        results[k] = e
                await h.wait(30)
                winners = [k for k, e in results.items() if e is None]
                assert len(winners) == 1, results
                (win,) = winners
                (lose,) = set(results) - {win}
                assert isinstance(results[lose], SourceConflict), results
                if i % 2 == 0:
                    assert win == "a"
                assert _digest(dst, dtable) == want[win], f"round {i}: pages are not {win}'s KV"
                assert t.conflicts >= 1 and t.takeovers == 0
            assert rx.stats["source_conflicts"] >= 20 and rx.stats["takeovers"] == 0
        finally:
            for s in tx.values():
                await s.close()
            await rx.close()

    arun(main(), 120)


def test_a_sender_killed_mid_transfer_is_taken_over_by_another_with_the_same_kv() -> None:
    """A sends through a proxy; once part of its bytes are in, its
    connections are cut (a killed prefill).  B, another sender holding the
    same KV, sends the same ticket: the receiver sees A gone, B takes over
    from what A delivered, and the pages are exactly that KV."""
    src = pack.PagedKVCache.allocate(SRC, PAGES, fill="random", seed=3)
    table = np.arange(PAGES, dtype=np.int32)

    async def main() -> None:
        rx = await TcpReceiver(compat_hash=DST.compat_hash).start()
        proxy = FaultProxy(rx.port)
        a = _sender(await proxy.start(), reconnect_timeout=1.0, connect_timeout=1.0)
        b = _sender(rx.port)
        dst = pack.PagedKVCache.allocate(DST, DST.pages_for(N))
        dtable = np.arange(DST.pages_for(N), dtype=np.int32)
        try:
            h = rx.expect("r", KVSink(dst, dtable, 0, N, None), timeout=30)
            t = h._transfer
            sa = a.send("r", KVSource(src, table, 0, N, None), token=h.token)
            await _until(lambda: t.received_bytes > 0)
            proxy.stall = True  # nothing more of A arrives
            held = t.received_bytes
            assert 0 < held < t.total
            await proxy.close()  # A's connections are reset: A is gone
            await _until(lambda: not t.attached)
            sb = b.send("r", KVSource(src, table, 0, N, None), token=h.token)
            st = await sb.wait(30)
            await h.wait(30)
            assert t.takeovers == 1 and t.conflicts == 0
            assert rx.stats["takeovers"] == 1 and rx.stats["source_conflicts"] == 0
            assert st.bytes == t.total  # B's handle counts the transfer
            assert _digest(dst, dtable) == _digest(src, table)
            with pytest.raises(KVBridgeError):
                await sa.wait(30)  # A never heard COMPLETE
        finally:
            await a.close()
            await b.close()
            await rx.close()

    arun(main(), 60)


def test_the_same_sender_resumes_after_its_connection_drops() -> None:
    """A's only connection is reset mid-transfer; A reconnects and re-opens
    the transfer under the same source id: accepted (no conflict, no
    takeover), and the pages are A's KV."""
    src = pack.PagedKVCache.allocate(SRC, PAGES, fill="random", seed=4)
    table = np.arange(PAGES, dtype=np.int32)

    async def main() -> None:
        rx = await TcpReceiver(compat_hash=DST.compat_hash).start()
        proxy = FaultProxy(rx.port, reset_after=[600 << 10])
        a = _sender(await proxy.start(), streams=1)
        dst = pack.PagedKVCache.allocate(DST, DST.pages_for(N))
        dtable = np.arange(DST.pages_for(N), dtype=np.int32)
        try:
            h = rx.expect("r", KVSink(dst, dtable, 0, N, None), timeout=30)
            await a.send("r", KVSource(src, table, 0, N, None), token=h.token).wait(30)
            await h.wait(30)
            t = h._transfer
            assert proxy.resets == 1 and proxy.connections >= 2
            assert t.takeovers == 0 and t.conflicts == 0
            assert _digest(dst, dtable) == _digest(src, table)
        finally:
            await a.close()
            await proxy.close()
            await rx.close()

    arun(main(), 60)


def test_tp_ranks_of_disjoint_head_ranges_both_land_one_head_range_has_one_source() -> None:
    """The decode holds the model's 8 heads; two prefill ranks hold [0, 4) and
    [4, 8) (ticket extension 0x81: one token per head range).  Both ranks
    send into one request and both complete; a third sender of heads [0, 4)
    with other KV is refused while rank 0 is live, and heads [0, 4) are rank
    0's."""
    rank = [SRC.replace(num_kv_heads=4, head_start=s, model_kv_heads=8) for s in (0, 4)]
    srcs = [pack.PagedKVCache.allocate(rank[r], PAGES, fill="random", seed=10 + r) for r in (0, 1)]
    rogue = pack.PagedKVCache.allocate(rank[0], PAGES, fill="random", seed=12)
    table = np.arange(PAGES, dtype=np.int32)

    async def main() -> None:
        rx = await TcpReceiver(compat_hash=DST.compat_hash).start()
        txs = [await _sender(rx.port).connect() for _ in range(3)]
        dst = pack.PagedKVCache.allocate(DST, DST.pages_for(N))
        dtable = np.arange(DST.pages_for(N), dtype=np.int32)
        try:
            hs = [
                rx.expect("r", KVSink(dst, dtable, 0, N, None, heads=hr), timeout=30)
                for hr in ((0, 4), (4, 8))
            ]
            sends = [
                txs[r].send("r", KVSource(srcs[r], table, 0, N, None), token=hs[r].token)
                for r in (0, 1)
            ]
            await _until(lambda: all(h._transfer.bound for h in hs))
            bad = txs[2].send("r", KVSource(rogue, table, 0, N, None), token=hs[0].token)
            with pytest.raises(SourceConflict):
                await bad.wait(30)
            for s in sends:
                await s.wait(30)
            for h in hs:
                await h.wait(30)
            for r, hr in enumerate(((0, 4), (4, 8))):
                assert _digest(dst, dtable, hr) == _digest(srcs[r], table)
            assert hs[0]._transfer.conflicts >= 1 and hs[1]._transfer.conflicts == 0
        finally:
            for s in txs:
                await s.close()
            await rx.close()

    arun(main(), 60)


def test_bridge_two_prefills_one_ticket_the_second_is_refused_with_source_conflict() -> None:
    """The same at the bridge: two PrefillBridges (other identities, other
    KV) given one decode's ticket (a retried request re-routed while its
    first prefill still sends); the second send fails with SourceConflict,
    the decode's request completes with the first prefill's KV."""
    from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge

    P = SRC.replace(dtype="bf16")
    src = [pack.PagedKVCache.allocate(P, PAGES, fill="random", seed=20 + i) for i in (0, 1)]
    table = np.arange(PAGES, dtype=np.int32)

    async def main() -> None:
        dst = pack.PagedKVCache.allocate(P, PAGES)
        md = await DecodeBridge(dst, identity="md", tcp_listen=("127.0.0.1", 0)).start()
        pres = [PrefillBridge(src[i], identity=f"p{i}") for i in (0, 1)]
        try:
            for pre in pres:
                await pre.connect("md", PeerConfig("tcp", *md.tcp_address, streams=2))  # type: ignore[arg-type]
            dtable = table[::-1].copy()
            e = md.expect("r", dtable, 0, N)
            first = pres[0].send("r", table, {"md": e.ticket})
            await asyncio.sleep(0)
            await _until(lambda: md_bound(md))
            second = pres[1].send("r", table, {"md": e.ticket})
            with pytest.raises(SourceConflict):
                await second.wait(30)
            await first.wait(30)
            await e.wait(30)
            got = bytes(np.asarray(pack.pack(dst, dtable, 0, N)))
            assert got == bytes(np.asarray(pack.pack(src[0], table, 0, N)))
            assert got != bytes(np.asarray(pack.pack(src[1], table, 0, N)))
        finally:
            for pre in pres:
                await pre.close()
            await md.close()

    arun(main(), 60)


def md_bound(md: Any) -> bool:
    """Whether the decode's TCP receiver has bound every transfer it expects."""
    rx = md.tcp  # the bridge's TcpReceiver
    return bool(rx._expected) and all(t.bound for t in rx._expected.values())
