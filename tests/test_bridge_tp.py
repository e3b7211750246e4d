"""Heterogeneous tensor parallelism through the bridge: P prefill ranks send to
D decode ranks (P != D), each rank's cache holding a contiguous range of the
model's KV heads.  Every byte a decode holds afterwards is checked against the
plain torch reference (kvbridge.testing.pack_ref) of one full cache of the
model, over TCP, over UCX and over the synchronous bridge; and the wrong
inputs are refused with typed errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.bridge import (
    DecodeBridge,
    PeerConfig,
    PrefillBridge,
    SyncBridge,
    Ticket,
    TicketTransport,
    plan_sources,
    tp_sources,
)
from kvbridge.errors import (
    Cancelled,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    LayoutError,
    OverlapError,
    TransferAborted,
)
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx
from kvbridge.transport.tcp import TcpSender
from kvbridge.transport.tcp.kvio import KVSource

pytest.importorskip("kvbridge._core")
from kvbridge import pack
from kvbridge.testing.pack_ref import ref_pack, ref_unpack

H = 8  # the model's KV heads
MODEL = KVLayout(num_layers=3, num_kv_heads=H, head_dim=16, dtype="bf16", page_tokens=16)
N = 45  # tokens: the last page is partial
START = 5  # the range starts mid-page (a prefix-cache hit)


def rank(heads: tuple[int, int], **kw: Any) -> KVLayout:
    """The layout of a rank holding the model's heads ``[a, b)``."""
    a, b = heads
    return MODEL.replace(num_kv_heads=b - a, head_start=a, model_kv_heads=H, **kw)


class Model:
    """One full cache of the model (the reference), and rank caches filled
    from it."""

    def __init__(self, seed: int = 7) -> None:
        self.full = pack.PagedKVCache.allocate(MODEL, 8, fill="random", seed=seed)
        self.table = np.array([3, 0, 6, 1], dtype=np.int32)

    def want(self, heads: tuple[int, int] = (0, H)) -> bytes:
        return bytes(ref_pack(self.full, self.table, START, N, heads=heads).numpy())

    def prefill(self, heads: tuple[int, int], **kw: Any) -> tuple[pack.PagedKVCache, np.ndarray]:
        lay = rank(heads, **kw)
        cache = pack.PagedKVCache.allocate(lay, 16)
        table = np.array([9, 2, 14, 5, 11, 0][: lay.pages_for(N)], dtype=np.int32)
        wire = ref_pack(self.full, self.table, 0, N, heads=heads)
        ref_unpack(cache, table, 0, N, wire)
        return cache, table


def decode(heads: tuple[int, int], **kw: Any) -> tuple[pack.PagedKVCache, np.ndarray]:
    """An empty decode rank (64-token NHD pages or as ``kw`` says)."""
    lay = rank(heads, **kw)
    cache = pack.PagedKVCache.allocate(lay, 12)
    table = np.array([7, 4, 10, 1, 8][: lay.pages_for(N)], dtype=np.int32)
    return cache, table


def got(cache: pack.PagedKVCache, table: np.ndarray) -> bytes:
    return bytes(ref_pack(cache, table, START, N).numpy())


# ---- sources and tickets (no transport) -------------------------------------------
def test_tp_sources_and_the_plan_of_a_receiver() -> None:
    assert tp_sources(["p0", "p1"], 8) == [("p0", (0, 4)), ("p1", (4, 8))]
    # more ranks than heads: each replicated head comes from its first rank
    assert tp_sources(["p0", "p1", "p2", "p3"], 2) == [("p0", (0, 1)), ("p2", (1, 2))]
    two = tp_sources(["p0", "p1"], 8)
    assert plan_sources((0, 8), two) == two
    assert plan_sources((2, 6), two) == [("p0", (2, 4)), ("p1", (4, 6))]
    assert plan_sources((4, 8), two) == [("p1", (4, 8))]  # p0 holds none of them
    with pytest.raises(OverlapError, match="'p0' and 'p1'"):
        plan_sources((0, 8), [("p0", (0, 5)), ("p1", (4, 8))])
    with pytest.raises(LayoutError, match=r"\[4, 6\)"):
        plan_sources((0, 8), [("p0", (0, 4)), ("p1", (6, 8))])
    with pytest.raises(LayoutError, match=r"\[6, 8\)"):
        plan_sources((0, 8), [("p0", (0, 6))])
    with pytest.raises(InvalidArgument):
        plan_sources((0, 8), [("p0", (0, 4)), ("p0", (4, 8))])
    with pytest.raises(LayoutError):
        plan_sources((0, 8), [("p0", (4, 4))])


def test_a_ticket_carries_its_head_range() -> None:
    t = Ticket(TicketTransport.TCP, "r", 0, 8, 0, 2, 5, token=bytes(16), heads=(4, 8))
    raw = t.encode()
    assert raw[4] == 2 and raw.endswith(bytes.fromhex("0b008108000400000008000000"))
    assert Ticket.decode(raw) == t
    both = Ticket(TicketTransport.UCX, "r", 0, 8, 0, 2, 5, agent_id=b"a" * 16,
                  block_table=(1, 2), model="m", heads=(0, 3))  # fmt: skip
    assert Ticket.decode(both.encode()) == both
    plain = Ticket(TicketTransport.TCP, "r", 0, 8, 0, 2, 5, token=bytes(16))
    assert plain.encode()[4] == 1 and Ticket.decode(plain.encode()).heads is None
    # a head range of 4 bytes, an empty one, or one given twice is refused
    base = plain.encode()
    v2 = bytearray(base)
    v2[4] = 2
    for ext in ("810400" "00000000", "810800" "03000000" "03000000",
                "810800" "00000000" "01000000" "810800" "00000000" "01000000"):  # fmt: skip
        e = bytes.fromhex(ext)
        bad = bytes(v2) + len(e).to_bytes(2, "little") + e
        with pytest.raises(KVBridgeError):
            Ticket.decode(bad)


def test_transfer_hash_names_the_heads() -> None:
    assert MODEL.transfer_hash() == MODEL.compat_hash == MODEL.transfer_hash((0, H))
    lo, hi = rank((0, 4)), rank((4, 8))
    assert lo.compat_hash == hi.compat_hash == MODEL.compat_hash
    assert lo.transfer_hash((0, 4)) == hi.transfer_hash((0, 4)) != MODEL.transfer_hash((4, 8))
    assert lo.transfer_hash((0, 4)) not in (MODEL.compat_hash, lo.transfer_hash((0, 3)))
    with pytest.raises(LayoutError):
        MODEL.transfer_hash((0, 9))


# ---- TCP -------------------------------------------------------------------------------
async def _decode(cache: pack.PagedKVCache, name: str, **kw: Any) -> DecodeBridge:
    return await DecodeBridge(cache, identity=name, tcp_listen=("127.0.0.1", 0), **kw).start()


async def _prefill(
    cache: pack.PagedKVCache, name: str, *decodes: tuple[str, DecodeBridge]
) -> PrefillBridge:
    pre = PrefillBridge(cache, identity=name)
    for dname, d in decodes:
        await pre.connect(dname, PeerConfig("tcp", *d.tcp_address, streams=2, chunk_size=1024))
    return pre


def test_tcp_two_prefill_ranks_to_one_decode() -> None:
    """P=2 -> D=1: the decode's request completes once both head ranges
    landed; its cache then holds every byte of the model's KV."""

    async def main() -> None:
        m = Model()
        dc, dt = decode((0, H), page_tokens=64, head_order="HND")
        md = await _decode(dc, "md")
        (c0, t0), (c1, t1) = m.prefill((0, 4)), m.prefill((4, 8), order="page_first")
        p0 = await _prefill(c0, "p0", ("md", md))
        p1 = await _prefill(c1, "p1", ("md", md))
        try:
            e = md.expect("r", dt, START, N, sources=tp_sources(["p0", "p1"], H))
            assert set(e.tickets) == {"p0", "p1"}
            assert Ticket.decode(e.tickets["p1"]).heads == (4, 8)
            with pytest.raises(InvalidArgument, match="tickets"):
                _ = e.ticket
            s0 = p0.send("r", t0, {"md": e.tickets["p0"]})
            await asyncio.sleep(0.05)
            assert not e.done()  # half the heads are not enough
            s1 = p1.send("r", t1, {"md": e.tickets["p1"]})
            out = await e.wait(30)
            await s0.wait(30)
            await s1.wait(30)
            assert out.bytes == MODEL.wire_nbytes(N - START)
            assert got(dc, dt) == m.want()
        finally:
            for b in (p0, p1, md):
                await b.close()

    arun(main(), timeout=60)


def test_tcp_one_prefill_to_two_decode_ranks() -> None:
    """P=1 -> D=2: each decode rank's ticket names its heads, the prefill
    sends each the wire of those heads, and each holds exactly its heads."""

    async def main() -> None:
        m = Model()
        pc, pt = m.prefill((0, H))
        (d0c, d0t), (d1c, d1t) = decode((0, 4)), decode((4, 8), page_tokens=32)
        d0, d1 = await _decode(d0c, "d0"), await _decode(d1c, "d1")
        pre = await _prefill(pc, "p", ("d0", d0), ("d1", d1))
        try:
            e0, e1 = d0.expect("r", d0t, START, N), d1.expect("r", d1t, START, N)
            assert Ticket.decode(e0.ticket).heads == (0, 4)
            out = await pre.send("r", pt, {"d0": e0.ticket, "d1": e1.ticket}).wait(30)
            await e0.wait(30)
            await e1.wait(30)
            assert out["d0"].bytes == MODEL.wire_nbytes(N - START) // 2
            assert got(d0c, d0t) == m.want((0, 4))
            assert got(d1c, d1t) == m.want((4, 8))
        finally:
            for b in (pre, d0, d1):
                await b.close()

    arun(main(), timeout=60)


def test_tcp_layerwise_sends_of_two_prefill_ranks() -> None:
    """Layer-wise sends of a head range: each rank's layers leave as they are
    released, and the decode completes once every layer of both ranges landed."""

    async def main() -> None:
        m = Model()
        dc, dt = decode((0, H))
        md = await _decode(dc, "md")
        (c0, t0), (c1, t1) = m.prefill((0, 4)), m.prefill((4, 8))
        p0 = await _prefill(c0, "p0", ("md", md))
        p1 = await _prefill(c1, "p1", ("md", md))
        try:
            e = md.expect("r", dt, START, N, sources=tp_sources(["p0", "p1"], H))
            lw0 = p0.send_layerwise("r", t0, {"md": e.tickets["p0"]}, layer_timeout=20)
            lw1 = p1.send_layerwise("r", t1, {"md": e.tickets["p1"]}, layer_timeout=20)
            for n in range(1, MODEL.num_layers + 1):
                lw0.layers_ready(n)
                lw1.layers_ready(n)
                await asyncio.sleep(0.02)
            await lw0.wait(30)
            await lw1.wait(30)
            await e.wait(30)
            assert got(dc, dt) == m.want()
        finally:
            for b in (p0, p1, md):
                await b.close()

    arun(main(), timeout=60)


def test_head_ranges_outside_the_cache_and_empty_intersections_are_refused() -> None:
    async def main() -> None:
        m = Model()
        dc, dt = decode((0, 4))
        md = await _decode(dc, "md")
        c1, t1 = m.prefill((4, 8))
        p1 = await _prefill(c1, "p1", ("md", md))
        try:
            with pytest.raises(LayoutError, match="outside the cache"):
                md.expect("r", dt, START, N, heads=(0, 6))  # the cache holds [0, 4)
            with pytest.raises(LayoutError, match="outside the cache"):
                KVSource(c1, t1, 0, N, None, (0, 8))
            with pytest.raises(OverlapError):
                md.expect("r", dt, START, N, sources=[("a", (0, 3)), ("b", (2, 4))])
            with pytest.raises(LayoutError, match="no source"):
                md.expect("r", dt, START, N, sources=[("a", (0, 3))])
            e = md.expect("r", dt, START, N)  # heads [0, 4): p1 holds none of them
            with pytest.raises(LayoutError, match="no head in common"):
                p1.send("r", t1, {"md": e.ticket})
            assert p1.live_sends == {}  # nothing started, nothing leased
            e.cancel("test over")
        finally:
            await p1.close()
            await md.close()

    arun(main(), timeout=60)


def test_bytes_of_the_wrong_heads_are_refused() -> None:
    """A sender that offers the heads [4, 8) under the token of the ticket for
    [0, 4) (the same number of bytes) is refused at its OPEN: the OPEN's
    layout hash names the heads (protocol.md 7), and nothing lands."""

    async def main() -> None:
        m = Model()
        dc, dt = decode((0, H))
        md = await _decode(dc, "md")
        pc, pt = m.prefill((0, H))
        tx = TcpSender(*md.tcp_address, identity="p", compat_hash=MODEL.compat_hash)
        try:
            e = md.expect("r", dt, START, N, sources=tp_sources(["p0", "p1"], H))
            t0 = Ticket.decode(e.tickets["p0"])
            wrong = KVSource(pc, pt, START, N, None, (4, 8))
            h = tx.send("r", wrong, token=t0.token, timeout=20)
            with pytest.raises(IncompatiblePeer, match="layout hash"):
                await h.wait(20)
            with pytest.raises(IncompatiblePeer):
                await e.wait(20)
            assert got(dc, dt) == bytes(len(m.want()))  # nothing landed
        finally:
            await tx.close()
            await md.close()

    arun(main(), timeout=60)


def test_one_failed_sender_fails_the_request_once_and_cancels_the_other_part() -> None:
    async def main() -> None:
        m = Model()
        dc, dt = decode((0, H))
        md = await _decode(dc, "md")
        (c0, t0), (c1, t1) = m.prefill((0, 4)), m.prefill((4, 8))
        p0 = await _prefill(c0, "p0", ("md", md))
        p1 = await _prefill(c1, "p1", ("md", md))
        try:
            e = md.expect("r", dt, START, N, sources=tp_sources(["p0", "p1"], H))
            ends: list[object] = []
            e.add_done_callback(lambda d: ends.append(d.outcome()))
            s1 = p1.send("r", t1, {"md": e.tickets["p1"]})
            s1.cancel("prefill rank 1 lost its pages")
            with pytest.raises(TransferAborted):
                await e.wait(20)
            s0 = p0.send("r", t0, {"md": e.tickets["p0"]})  # its part was cancelled
            with pytest.raises((TransferAborted, Cancelled)):
                await s0.wait(20)
            await asyncio.sleep(0.1)
            assert len(ends) == 1 and isinstance(ends[0], TransferAborted)
        finally:
            for b in (p0, p1, md):
                await b.close()

    arun(main(), timeout=60)


# ---- the synchronous bridge --------------------------------------------------------------
def _poll_until(bridges: list[SyncBridge], pred: Any, seconds: float = 20.0) -> list[Any]:
    events: list[Any] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for b in bridges:
            ev = b.poll()
            events += [("done", b.identity, x) for x in ev.received + ev.sent]
            events += [("failed", b.identity, x) for x in ev.failed]
        if pred(events):
            return events
        time.sleep(0.02)
    return events


def test_sync_bridge_two_prefill_ranks_to_one_decode() -> None:
    m = Model()
    dc, dt = decode((0, H), page_tokens=32)
    (c0, t0), (c1, t1) = m.prefill((0, 4)), m.prefill((4, 8))
    with (
        SyncBridge(dc, identity="md", tcp_listen=("127.0.0.1", 0)) as md,
        SyncBridge(c0, identity="p0") as p0,
        SyncBridge(c1, identity="p1") as p1,
    ):
        for p in (p0, p1):
            p.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port, streams=2))
        tickets = md.expect("r", dt, START, N, sources=tp_sources(["p0", "p1"], H), peer="p")
        assert isinstance(tickets, dict) and set(tickets) == {"p0", "p1"}
        p0.send("r", t0, {"md": tickets["p0"]})
        p1.send("r", t1, {"md": tickets["p1"]})
        ev = _poll_until(
            [md, p0, p1],
            lambda e: (
                sum(1 for k, who, _ in e if who == "md") >= 1
                and sum(1 for k, who, _ in e if who != "md") >= 2
            ),
        )
        time.sleep(0.1)
        ev += _poll_until([md, p0, p1], lambda e: True, 0.05)
        at_md = [(k, x) for k, who, x in ev if who == "md"]
        assert [k for k, _ in at_md] == ["done"], ev  # one TransferDone for the request
        assert at_md[0][1].request_id == "r" and at_md[0][1].peer == "p"
        assert at_md[0][1].stats.bytes == MODEL.wire_nbytes(N - START)
        assert got(dc, dt) == m.want()


def test_sync_bridge_reports_a_failed_part_once() -> None:
    """One of two prefill ranks fails (its send is cancelled): the decode's
    poll() reports the request once, as failed with the typed error, and the
    other rank's part is cancelled too (its send then fails)."""
    m = Model()
    dc, dt = decode((0, H))
    (c0, t0), (c1, t1) = m.prefill((0, 4)), m.prefill((4, 8))
    with (
        SyncBridge(dc, identity="md", tcp_listen=("127.0.0.1", 0)) as md,
        SyncBridge(c0, identity="p0") as p0,
        SyncBridge(c1, identity="p1") as p1,
    ):
        for p in (p0, p1):
            p.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port))
        tickets = md.expect("r", dt, START, N, sources=tp_sources(["p0", "p1"], H))
        # layer-wise with no layer ready: the part cannot complete before the
        # cancel (a small part sent whole can land before a cancel from
        # another thread reaches the loop)
        p1.send("r", t1, {"md": tickets["p1"]}, layerwise=True)
        p1.cancel("r", "rank 1 lost its pages")
        ev = _poll_until([md, p1], lambda e: any(who == "md" for _, who, _ in e))
        p0.send("r", t0, {"md": tickets["p0"]})
        ev += _poll_until([md, p0], lambda e: any(who == "p0" for _, who, _ in e))
        time.sleep(0.3)
        ev += _poll_until([md, p0, p1], lambda e: True, 0.05)
        at_md = [(k, x) for k, who, x in ev if who == "md"]
        assert len(at_md) == 1 and at_md[0][0] == "failed", ev
        assert at_md[0][1].request_id == "r" and isinstance(at_md[0][1].error, TransferAborted)
        at_p0 = [(k, x) for k, who, x in ev if who == "p0"]
        assert [k for k, _ in at_p0] == ["failed"], ev  # its part was cancelled
        assert md.pending == ([], [])
        assert got(dc, dt) != m.want()


def test_ucx_metadata_names_a_ranks_heads() -> None:
    from kvbridge.transport.ucx.metadata import (
        AgentMetadata,
        RegionInfo,
        RegionKind,
        decode_metadata,
        encode_metadata,
    )

    regions = tuple(RegionInfo(RegionKind.CACHE, i, 4096 * i, 4096, b"rk") for i in range(3))
    for lay in (MODEL, rank((4, 8)), rank((0, 2), head_order="HND")):
        blob = encode_metadata(AgentMetadata(bytes(16), 1, lay, 8, b"addr", regions))
        assert blob[8] == (1 if lay.holds_all_heads else 2)  # version 1: the bytes as before
        back = decode_metadata(blob).layout
        assert back == lay and back.head_range == lay.head_range
        assert back.exact_hash == lay.exact_hash and back.compat_hash == MODEL.compat_hash


# ---- UCX ---------------------------------------------------------------------------------
needs_ucx = pytest.mark.skipif(
    not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"
)


@needs_ucx
def test_ucx_two_prefill_ranks_to_one_decode_and_one_to_two() -> None:
    """Over UCX (staging path: the ranks' memory layouts differ by their
    heads): P=2 -> D=1, then P=1 -> D=2 on the same ranks' caches."""

    async def main() -> None:
        m = Model()
        dc, dt = decode((0, H), head_order="HND")
        md = await DecodeBridge(dc, identity="md", ucx=True).start()
        (c0, t0), (c1, t1) = m.prefill((0, 4)), m.prefill((4, 8))
        p0, p1 = PrefillBridge(c0, identity="p0"), PrefillBridge(c1, identity="p1")
        pc, pt = m.prefill((0, H))
        (d0c, d0t), (d1c, d1t) = decode((0, 4)), decode((4, 8))
        d0 = await DecodeBridge(d0c, identity="d0", ucx=True).start()
        d1 = await DecodeBridge(d1c, identity="d1", ucx=True).start()
        pre = PrefillBridge(pc, identity="p")
        try:
            for p in (p0, p1):
                await p.connect("md", PeerConfig("ucx", metadata=md.ucx_metadata()))
            e = md.expect("r", dt, START, N, via="ucx", sources=tp_sources(["p0", "p1"], H))
            s0 = p0.send("r", t0, {"md": e.tickets["p0"]})
            await s0.wait(30)
            assert not e.done()
            s1 = p1.send("r", t1, {"md": e.tickets["p1"]})
            out = await e.wait(30)
            assert (await s1.wait(30))["md"].path == "ucx-staging"
            assert out.bytes == MODEL.wire_nbytes(N - START)
            assert got(dc, dt) == m.want()

            await pre.connect("d0", PeerConfig("ucx", metadata=d0.ucx_metadata()))
            await pre.connect("d1", PeerConfig("ucx", metadata=d1.ucx_metadata()))
            e0 = d0.expect("r", d0t, START, N, via="ucx")
            e1 = d1.expect("r", d1t, START, N, via="ucx")
            await pre.send("r", pt, {"d0": e0.ticket, "d1": e1.ticket}).wait(30)
            await e0.wait(30)
            await e1.wait(30)
            assert got(d0c, d0t) == m.want((0, 4))
            assert got(d1c, d1t) == m.want((4, 8))
        finally:
            for b in (p0, p1, pre, md, d0, d1):
                await b.close()

    arun(main(), timeout=90)


@needs_ucx
def test_ucx_same_heads_use_the_put_path_and_wrong_heads_are_refused() -> None:
    """Two ranks holding the same heads in the same memory layout exchange
    them with one-sided puts; a UCX part of other heads than expected is
    refused by the receiver, and nothing of it is unpacked."""

    async def main() -> None:
        m = Model()
        c1, t1 = m.prefill((4, 8))
        dc, dt = decode((4, 8), page_tokens=16)
        md = await DecodeBridge(dc, identity="md", ucx=True).start()
        p1 = PrefillBridge(c1, identity="p1", ucx_options={"min_put_run_bytes": 0})
        pc, pt = m.prefill((0, H))
        wide = await DecodeBridge(*decode((0, H))[:1], identity="wide", ucx=True).start()
        pre = PrefillBridge(pc, identity="p")
        try:
            await p1.connect("md", PeerConfig("ucx", metadata=md.ucx_metadata()))
            e = md.expect("r", dt, START, N, via="ucx")
            out = await p1.send("r", t1, {"md": e.ticket}).wait(30)
            await e.wait(30)
            assert out["md"].path == "ucx-put"
            assert got(dc, dt) == m.want((4, 8))

            await pre.connect("wide", PeerConfig("ucx", metadata=wide.ucx_metadata()))
            ex = wide.expect("w", dt, START, N, via="ucx", sources=tp_sources(["a", "b"], H))
            peer = pre.destination("wide").peer
            t_a = Ticket.decode(ex.tickets["a"])  # heads [0, 4); "b" brings [4, 8)
            h = peer.send("w", pt, list(t_a.block_table), START, N, heads=(2, 6))
            with pytest.raises(IncompatiblePeer, match="expected for heads"):
                await h  # no part of the request brings [2, 6): refused
            ex.cancel("test over")
            with pytest.raises(KVBridgeError):
                await ex.wait(10)
            assert not ex.parts["a"].done() or isinstance(ex.parts["a"].outcome(), KVBridgeError)
        finally:
            for b in (p1, pre, md, wide):
                await b.close()

    arun(main(), timeout=90)
