"""The UCX small-transfer fast path and the put window: DONE encoded and
parsed in C++ (the twin of the Python codec), a receive that lands in the
engine's expectation table and is seen by a polling ``done()`` without an
event-loop turn, awaiting with one loop hop, and put batches posted through a
bounded window of puts in flight per endpoint."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from ucx_cases import SMALL, make_cache, same_tokens
from ucx_cases import agent as ucx_agent

from kvbridge.errors import (
    IncompatiblePeer,
    InvalidArgument,
    PeerGone,
    RemoteProtocolError,
    TransferTimeout,
)
from kvbridge.layout import DType, KVLayout
from kvbridge.transport import ucx
from kvbridge.transport.ucx.loader import load
from kvbridge.transport.ucx.messages import Kind, Message, encode_message

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"),
]


def run(fn: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(fn(), timeout)

    asyncio.run(main())


# ---- the DONE codec in C++ -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rid", "fields"),
    [
        ("r1", (0, 32, 0, 2, 4096, 7)),
        ("", (0, 0, 0, 0, 0, 0)),
        ("é" * 512, (5, 2**40, 3, 7, 2**63, 2**64 - 1)),
    ],
)
def test_done_encoded_in_cpp_is_the_python_encoding(rid: str, fields: tuple[int, ...]) -> None:
    mod = load()
    sender = bytes(range(16))
    start, end, l0, l1, nbytes, pages = fields
    ours = mod.encode_done(sender, rid.encode(), start, end, l0, l1, nbytes, pages)
    want = Message(Kind.DONE, sender, rid, start, end, l0, l1, nbytes, offset=pages)
    assert ours == encode_message(want)
    assert mod.parse_done(ours) == (sender, rid.encode(), start, end, l0, l1, nbytes, pages)


def test_pages_digest_in_cpp_is_the_documented_one() -> None:
    from kvbridge.transport.ucx.messages import pages_digest_py

    mod = load()
    rng = np.random.default_rng(3)
    for _ in range(50):
        pt = int(rng.integers(1, 17))
        start = int(rng.integers(0, 40))
        end = int(rng.integers(start, 80))
        bt = rng.integers(-(2**40), 2**40, -(-80 // pt)).astype(np.int64)
        want = pages_digest_py([int(x) for x in bt], start, end, pt)
        assert mod.pages_digest(bt, start, end, pt) == want
    # a table one page short of the range is refused
    with pytest.raises(IndexError):
        mod.pages_digest(np.arange(2, dtype=np.int64), 0, 9, 4)


def test_cpp_parses_only_well_formed_done() -> None:
    mod = load()
    sender = b"A" * 16
    good = encode_message(Message(Kind.DONE, sender, "r", 1, 2, 0, 1, 8, text="t", blob=b"b"))
    assert mod.parse_done(good) == (sender, b"r", 1, 2, 0, 1, 8, 0)
    # a DONE of version 3 is read alike (version 4 changed ABORT only)
    assert mod.parse_done(good[:2] + b"\x03" + good[3:]) == (sender, b"r", 1, 2, 0, 1, 8, 0)
    others = [
        good[:2] + b"\x02" + good[3:],  # version 2 (no connection tags): Python drops it
        good[:2] + b"\x05" + good[3:],  # version 5
        good[:-1],  # lengths do not add up
        good + b"x",
        b"\x00" + good[1:],  # magic
        good[:3] + b"\x08" + good[4:],  # another kind (ABORT)
        good[:100] + (1025).to_bytes(2, "little") + good[102:],  # request id too long
        good[:50],
        encode_message(Message(Kind.PING, sender)),
    ]
    for bad in others:
        assert mod.parse_done(bad) is None, bad.hex()


def test_request_id_longer_than_the_codec_allows_is_refused_before_posting() -> None:
    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, 1), min_put_run_bytes=0)
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None), min_put_run_bytes=0)
        peer = await a.connect(b.metadata())
        with pytest.raises(InvalidArgument, match="1024"):
            peer.send("x" * 1025, np.arange(2), np.arange(2), 0, 16)
        await a.close()
        await b.close()

    run(body)


# ---- a receive seen by polling, without the event loop -------------------------------------
@pytest.mark.parametrize("progress", ["thread", "loop"])
def test_polling_done_sees_a_landed_receive_without_a_loop_turn(progress: str) -> None:
    """The DONE lands in the engine's table; ``done()`` progresses the worker
    and accounts it, so a caller that never yields to the loop sees it."""

    async def body() -> None:
        src, dst = make_cache(SMALL, 16, 3), make_cache(SMALL, 16, None)
        kw: dict[str, Any] = {"progress": progress, "min_put_run_bytes": 0}
        a, b = ucx_agent(SMALL, src, **kw), ucx_agent(SMALL, dst, **kw)
        peer = await a.connect(b.metadata())
        for i in range(10):
            bt = np.random.default_rng(i).permutation(16)[:5]
            he = b.expect(f"p{i}", bt, 2, 40)
            hs = peer.send(f"p{i}", bt, bt, 2, 40)
            deadline = time.monotonic() + 5
            # no await between the send and the end of this loop: only done()
            # can progress the workers and account what arrived
            while not (hs.done() and he.done()) and time.monotonic() < deadline:
                pass
            assert hs.done() and he.done(), (progress, i)
            st, rt = hs.stats, he.stats
            assert st.path == rt.path == "put" and rt.bytes == SMALL.wire_nbytes(38)
            assert rt.layers_done == SMALL.num_layers
            assert same_tokens(SMALL, src, bt, SMALL, dst, bt, 2, 40)
            assert (await he).bytes == rt.bytes
        await a.close()
        await b.close()

    run(body)


def test_a_receive_takes_only_its_own_request_from_the_engine() -> None:
    """``done()`` of a receive whose DONEs completed it in the engine takes
    them out of the engine's queue (``poll_take``) and resolves only that
    receive, with the bytes of all its parts (two layer ranges here); the
    other request's DONE stays queued for the loop, and nothing is accounted
    twice."""

    async def body() -> None:
        src, dst = make_cache(SMALL, 8, 3), make_cache(SMALL, 8, None)
        a = ucx_agent(SMALL, src, min_put_run_bytes=0)
        b = ucx_agent(SMALL, dst, min_put_run_bytes=0)
        peer = await a.connect(b.metadata())
        bt_x, bt_y = np.array([0, 1]), np.array([2, 3])
        hx = b.expect("x", bt_x, 0, 16)
        hy = b.expect("y", bt_y, 0, 16)
        assert hx.token and hy.token and hx.token != hy.token
        sends = [
            peer.send("y", bt_y, bt_y, 0, 16),
            peer.send("x", bt_x, bt_x, 0, 16, layers=(0, 1)),
            peer.send("x", bt_x, bt_x, 0, 16, layers=(1, SMALL.num_layers)),
        ]
        # no await until the end: the loop does not turn, so only the calls
        # here progress the workers and account what arrived
        eng = b._engine
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # both requests' DONEs queued, nothing drained
            sent = all(h.done() for h in sends)
            if sent and eng.expect_state(hx.token)[0] == eng.expect_state(hy.token)[0] == -1:
                break
            eng.poll(100, 0, 0)
        assert eng.expect_state(hx.token) == (-1, False)  # complete: forgotten by the engine
        assert not hx.settled and not hy.settled  # no loop turn yet: nothing accounted
        assert eng.poll_take(0, 2**40, 0) == -2  # not that request's: others are queued
        assert hx.done() and not hy.settled  # hx took its own DONEs only
        assert hx.stats.bytes == SMALL.wire_nbytes(16) and hx.stats.path == "put"
        assert hx.stats.layers_done == SMALL.num_layers
        landed = eng.drain()[3]  # what the loop would account next: hy's DONE alone
        assert [rec[0] for rec in landed] == [hy.token], landed
        b._expectations.on_landed(*_landed_args(b, landed[0]))
        assert hy.settled and hy.stats.bytes == SMALL.wire_nbytes(16)
        assert eng.poll_take(0, hx.token, 0) == -1  # nothing left queued
        assert same_tokens(SMALL, src, bt_x, SMALL, dst, bt_x, 0, 16)
        for h in sends:
            assert (await h).path == "put"
        await a.close()
        await b.close()

    run(body)


def _landed_args(agent: Any, rec: tuple[Any, ...]) -> tuple[Any, ...]:
    token, _l0, _l1, nbytes, sender, layers, complete = rec
    return (token, nbytes, agent._peers.get(sender), layers, complete)


def test_awaiting_a_receive_resumes_after_one_loop_hop() -> None:
    """A task awaiting a receive is woken by the handle itself (one call_soon
    hop), not through a shield's two: it runs before a callback scheduled
    right after the resolution."""

    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, 1), min_put_run_bytes=0)
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None), min_put_run_bytes=0)
        await a.connect(b.metadata())
        loop = asyncio.get_running_loop()
        h = b.expect("hop", np.arange(3), 0, 20)
        order: list[str] = []

        async def waiter() -> None:
            await h
            order.append("woken")

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)  # the task now waits on the handle
        ex = h.owner
        b._expectations.on_landed(ex.token, 0, None, SMALL.num_layers, True)  # resolves it
        loop.call_soon(order.append, "one hop later")
        await task
        assert order[0] == "woken", order
        await a.close()
        await b.close()

    run(body)


def test_a_finished_receive_leaves_its_deadline_entry_and_stays_a_success() -> None:
    """A receive that completes leaves its entry in the agent's deadlines
    (one loop timer for all its handles); when the timer reaches it, the
    handle is resolved: it stays a success and no ABORT goes out.  A
    receive still pending at its deadline fails and is aborted."""

    async def body() -> None:
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None), min_put_run_bytes=0)
        aborted: list[str] = []
        b._abort = lambda h, exc: aborted.append(h.request_id)  # type: ignore[method-assign]
        early = b.expect("early", np.arange(3), 0, 20, timeout=0.05)
        b._expectations.on_landed(early.owner.token, 0, None, SMALL.num_layers, True)
        assert early.done() and len(b._deadlines) == 1
        late = b.expect("late", np.arange(3), 0, 20, timeout=0.6)
        await asyncio.sleep(0.2)  # the timer reached the first entry only
        assert (await early).layers_done == SMALL.num_layers
        assert aborted == [] and len(b._deadlines) == 1 and not late.done()
        with pytest.raises(TransferTimeout):
            await late  # a deadline that is not spent still fails the receive
        assert aborted == ["late"] and len(b._deadlines) == 0
        await b.close()

    run(body)


@pytest.mark.parametrize("mla", [False, True])
def test_expected_bytes_are_the_wire_bytes(mla: bool) -> None:
    """expect() sizes a receive of all the cache's heads without the general
    wire formula; it must agree with it for every layer range."""
    lay = KVLayout(num_layers=3, num_kv_heads=1 if mla else 2, head_dim=16, page_tokens=4, mla=mla)

    async def body() -> None:
        b = ucx_agent(lay, make_cache(lay, 8, None))
        for i, (layers, start, end) in enumerate(
            [(None, 0, 13), ((1, 3), 2, 9), ((0, 0), 0, 4), (None, 5, 5)]
        ):
            h = b.expect(f"r{i}", np.arange(4), start, end, layers)
            assert h.total_bytes == lay.wire_nbytes(end - start, layers), (layers, start, end)
            h.cancel()
        await b.close()

    run(body)


@pytest.mark.parametrize(("busy_poll_us", "tokens"), [(1000, 20), (0, 20), (1000, 500)])
def test_await_polls_inline_within_the_busy_poll_window(busy_poll_us: int, tokens: int) -> None:
    """``await handle`` of a small transfer first polls the worker for a
    bounded slice (at most the agent's busy_poll_us) and returns without a
    loop turn when the transfer completes in it; with busy_poll_us=0 it
    polls once and waits; a transfer above AWAIT_SPIN_MAX_BYTES (500 tokens
    of SMALL: 500 KiB) is not spun for."""
    from kvbridge.transport.ucx.handle import AWAIT_SPIN_MAX_BYTES, AWAIT_SPIN_US

    small = SMALL.wire_nbytes(tokens) <= AWAIT_SPIN_MAX_BYTES
    pages = -(-tokens // SMALL.page_tokens)

    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, pages, 2), min_put_run_bytes=0)
        b = ucx_agent(SMALL, make_cache(SMALL, pages, None), busy_poll_us=busy_poll_us)
        peer = await a.connect(b.metadata())
        spins: list[int] = []
        poll_now = b._poll_now

        def recording(spin_us: int = 0, token: int = 0) -> None:
            spins.append(spin_us)
            poll_now(spin_us, token)

        b._poll_now = recording  # type: ignore[method-assign]
        bt = np.arange(pages)
        h = b.expect("inline", bt, 0, tokens)
        hs = peer.send("inline", bt, bt, 0, tokens)
        stats = await h  # no loop turn since expect(): h was not accounted yet
        assert stats.bytes == SMALL.wire_nbytes(tokens)
        assert (AWAIT_SPIN_US in spins) == small  # the await's own slice, if small
        await hs
        await a.close()
        await b.close()

    run(body)


def test_cancelling_the_awaiting_task_leaves_the_receive_alone() -> None:
    async def body() -> None:
        src, dst = make_cache(SMALL, 8, 4), make_cache(SMALL, 8, None)
        a = ucx_agent(SMALL, src, min_put_run_bytes=0)
        b = ucx_agent(SMALL, dst, min_put_run_bytes=0)
        peer = await a.connect(b.metadata())
        he = b.expect("c", np.arange(3), 0, 20)
        task = asyncio.ensure_future(he.wait(5))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not he.done()
        await peer.send("c", np.arange(3), np.arange(3), 0, 20)
        assert (await he).bytes == SMALL.wire_nbytes(20)
        await a.close()
        await b.close()

    run(body)


def test_parts_the_table_does_not_take_still_reach_python() -> None:
    """Early parts, a part with other tokens, a part from another peer: the
    engine leaves them to Python, which keeps its rules."""

    async def body() -> None:
        src, dst = make_cache(SMALL, 16, 2), make_cache(SMALL, 16, None)
        a = ucx_agent(SMALL, src, min_put_run_bytes=0)
        c = ucx_agent(SMALL, make_cache(SMALL, 16, 9), min_put_run_bytes=0)
        b = ucx_agent(SMALL, dst, min_put_run_bytes=0)
        pa, pc = await a.connect(b.metadata()), await c.connect(b.metadata())
        bt = np.arange(7)
        # a layer that lands before its expect, then the rest through the table
        await pa.send("e", bt, bt, 0, 50, layers=(0, 1))
        await asyncio.sleep(0.05)
        he = b.expect("e", bt, 0, 50)
        await pa.send("e", bt, bt, 0, 50, layers=(1, SMALL.num_layers))
        assert (await he.wait(5)).layers_done == SMALL.num_layers
        assert same_tokens(SMALL, src, bt, SMALL, dst, bt, 0, 50)
        # bound to a's part: c's part of the same request is refused
        hx = b.expect("x", bt, 0, 50)
        await pa.send("x", bt, bt, 0, 50, layers=(0, 1))
        with pytest.raises(IncompatiblePeer):
            await pc.send("x", bt, bt, 0, 50, layers=(1, 2)).wait(5)
            await asyncio.sleep(0.5)  # the refusal arrives after the put completed
            raise IncompatiblePeer("the refusal did not fail a later send")
        assert not hx.done()
        # other tokens than expected: the receive fails, the sender is refused
        hy = b.expect("y", bt, 0, 50)
        await pa.send("y", bt, bt, 0, 40)
        with pytest.raises(RemoteProtocolError):
            await hy.wait(5)
        for ag in (a, b, c):
            await ag.close()

    run(body)


def test_a_part_read_after_its_peer_failed_fails_the_receive() -> None:
    """The engine can hand Python a peer's failure and a part that peer sent
    before it died in one drain, the failure first (or the part in a later
    drain): the receive, still unbound when the failure came, fails as soon
    as the part binds it to the gone peer, not at its deadline.  A part that
    completes the receive still completes it."""

    async def body() -> None:
        a = ucx_agent(SMALL, make_cache(SMALL, 8, 1), min_put_run_bytes=0)
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None), min_put_run_bytes=0)
        await a.connect(b.metadata())
        (pb,) = b.peers
        bt = np.arange(4)
        part, whole, staged = (b.expect(r, bt, 0, 30, timeout=30) for r in ("p", "w", "s"))
        await a.close()
        for _ in range(500):
            if pb.error is not None:
                break
            await asyncio.sleep(0.01)
        assert isinstance(pb.error, PeerGone)
        assert not (part.done() or whole.done() or staged.done())  # unbound: nothing to fail
        b._expectations.on_landed(part.owner.token, 0, pb, 1, False)
        with pytest.raises(PeerGone):
            await part.wait(1)
        b._expectations.on_landed(whole.owner.token, 0, pb, SMALL.num_layers, True)
        assert (await whole.wait(1)).layers_done == SMALL.num_layers
        req = Message(Kind.STAGE_REQ, pb.agent_id, "s", 0, 30, 0, 1, nbytes=1)
        b._expectations.on_part(pb, req, SMALL.head_range)
        with pytest.raises(PeerGone):
            await staged.wait(1)
        await b.close()

    run(body)


# ---- the put window ------------------------------------------------------------------------
PAGED = KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=512, dtype=DType.FP16, page_tokens=16, mla=True
)


@pytest.mark.parametrize("window", [0, 1, 3, 64])
def test_put_window_moves_every_run_exactly(window: int) -> None:
    """Scattered pages (one put per page and layer) through windows smaller
    and larger than the batch, two batches at once on one endpoint."""

    async def body() -> None:
        pages = 96
        src, dst = make_cache(PAGED, pages, 5), make_cache(PAGED, pages, None)
        kw: dict[str, Any] = {"put_window": window, "min_put_run_bytes": 0}
        a, b = ucx_agent(PAGED, src, **kw), ucx_agent(PAGED, dst, **kw)
        peer = await a.connect(b.metadata())
        rng = np.random.default_rng(window)
        big_src, big_dst = rng.permutation(pages)[:80], rng.permutation(pages)[:80]
        rest = np.setdiff1d(np.arange(pages), big_dst)
        small_src, small_dst = rng.permutation(pages)[:4], rest[:4]
        hb = b.expect("big", big_dst, 0, 80 * 16)
        hs = b.expect("small", small_dst, 0, 4 * 16)
        sb = peer.send("big", big_src, big_dst, 0, 80 * 16)
        ss = peer.send("small", small_src, small_dst, 0, 4 * 16)
        assert sb.stats.runs == 80 * PAGED.num_layers
        for h in (sb, ss, hb, hs):
            await h.wait(20)
        assert same_tokens(PAGED, src, big_src, PAGED, dst, big_dst, 0, 80 * 16)
        assert same_tokens(PAGED, src, small_src, PAGED, dst, small_dst, 0, 4 * 16)
        await a.close()
        await b.close()

    run(body)


def test_put_window_is_checked() -> None:
    with pytest.raises(InvalidArgument):
        ucx_agent(SMALL, make_cache(SMALL, 4, None), put_window=-1)


# ---- a send prepared once, posted under many request ids ------------------------------------
@pytest.mark.parametrize("layout", [SMALL, SMALL.replace(order="page_first", stacked=True)])
def test_a_prepared_send_moves_its_range_under_each_request_id(layout: KVLayout) -> None:
    """``prepare_send`` checks the range and computes its runs once; each
    ``post`` sends the pages as they are then, under its own request id,
    and the receiver expects each request as usual."""

    async def body() -> None:
        src, dst = make_cache(layout, 16, 4), make_cache(layout, 16, None)
        a = ucx_agent(layout, src, min_put_run_bytes=0)
        b = ucx_agent(layout, dst, min_put_run_bytes=0)
        peer = await a.connect(b.metadata())
        sbt, dbt = np.array([3, 9, 4]), np.array([12, 0, 7])
        prep = peer.prepare_send(sbt, dbt, 2, 21, layers=(1, 3))
        assert prep.nbytes == layout.wire_nbytes(19, (1, 3), layout.head_range)
        assert prep.runs >= 1
        for i in range(4):
            for t in src:  # the pages change between posts: a post sends what they hold then
                t[...] = np.random.default_rng(10 + i).integers(0, 2**16, t.shape, dtype=t.dtype)
            he = b.expect(f"r{i}", dbt, 2, 21, layers=(1, 3))
            hs = prep.post(f"r{i}")
            sst, rst = await hs, await he
            assert sst.path == "put" and sst.bytes == rst.bytes == prep.nbytes
            assert sst.runs == prep.runs and rst.layers_done == 2
            assert same_tokens(layout, src, sbt, layout, dst, dbt, 2, 21, layers=(1, 3))
        with pytest.raises(InvalidArgument, match="1024"):
            prep.post("x" * 1025)
        await a.close()
        with pytest.raises(Exception, match="closed"):
            prep.post("after")
        await b.close()

    run(body)


def test_a_prepared_send_is_checked_when_made() -> None:
    """A bad range, pages outside either cache and caches of different
    layouts fail at ``prepare_send`` with typed errors, before any post;
    a peer that is gone fails each post with its error."""

    async def body() -> None:
        from kvbridge.errors import LayoutError, PageIndexError

        a = ucx_agent(SMALL, make_cache(SMALL, 8, 1), min_put_run_bytes=0)
        b = ucx_agent(SMALL, make_cache(SMALL, 8, None), min_put_run_bytes=0)
        other = SMALL.replace(page_tokens=16)
        c = ucx_agent(other, make_cache(other, 8, None), min_put_run_bytes=0)
        peer = await a.connect(b.metadata())
        with pytest.raises(LayoutError):
            peer.prepare_send(np.arange(2), np.arange(2), 9, 3)
        with pytest.raises(PageIndexError):
            peer.prepare_send(np.array([0, 8]), np.arange(2), 0, 16)  # our page 8 of 8
        with pytest.raises(PageIndexError):
            peer.prepare_send(np.arange(2), np.array([0, 8]), 0, 16)  # the peer's page 8
        with pytest.raises(PageIndexError):
            peer.prepare_send(np.arange(1), np.arange(2), 0, 16)  # tokens past our table
        with pytest.raises(LayoutError, match="same layout"):
            (await a.connect(c.metadata())).prepare_send(np.arange(1), np.arange(1), 0, 8)
        prep = peer.prepare_send(np.arange(2), np.arange(2), 0, 16)
        peer._gone(PeerGone("test: the peer went away"))
        with pytest.raises(PeerGone):
            prep.post("r")
        for agent in (a, b, c):
            await agent.close()

    run(body)
