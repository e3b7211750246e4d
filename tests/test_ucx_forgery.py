"""A completion that cannot be forged (docs/ucx.md, "Who sent it"): three real
agents over UCX_TLS=tcp.  A receiver's pages are pre-filled and hashed; a
DONE from an agent without the key, a DONE naming another agent as its
sender, a DONE from the wrong peer and a put into other pages than the
expected ones are each dropped with a count (or fail the expect, typed),
and the expect never completes while the pages hold the pre-fill.  An
honest transfer still lands byte for byte; what one peer may keep waiting
before its expects is bounded; a dead peer leaves ``agent.peers``."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from ucx_cases import SMALL, TEST_PSK, make_cache

from kvbridge.errors import AuthenticationError, RemoteProtocolError
from kvbridge.transport import ucx
from kvbridge.transport.ucx.expect import MAX_EARLY_PER_PEER
from kvbridge.transport.ucx.messages import Kind, Message, encode_message

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"),
]

TCP = {"TLS": "tcp"}
PAGES = 64
PT = SMALL.page_tokens
TOKENS = 2 * PT  # two pages per request


def run(fn: Callable[[], Awaitable[None]], timeout: float = 60.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(fn(), timeout)

    asyncio.run(main())


CACHES: dict[int, list[np.ndarray]] = {}


def agent(seed: int | None, **kw: Any) -> ucx.UcxAgent:
    kw.setdefault("psk", TEST_PSK)
    kw.setdefault("min_put_run_bytes", 0)
    cache = make_cache(SMALL, PAGES, seed)
    a = ucx.UcxAgent(SMALL, cache, config=TCP, **kw)
    CACHES[id(a)] = cache
    return a


def digest(cache: list[np.ndarray], pages: np.ndarray) -> str:
    """A hash of the pages ``pages`` in every layer tensor of a (kv_first) cache."""
    h = hashlib.sha256()
    for t in cache:
        h.update(np.ascontiguousarray(t[:, pages]).tobytes())
    return h.hexdigest()


def cache_of(a: ucx.UcxAgent) -> list[np.ndarray]:
    return CACHES[id(a)]


async def trio() -> tuple[ucx.UcxAgent, ucx.UcxAgent, ucx.UcxAgent, Any, Any]:
    """Receiver A (pre-filled), senders B and C (other fills); B and C connected to A."""
    a, b, c = agent(1), agent(2), agent(3)
    pb = await b.connect(a.metadata())
    pc = await c.connect(a.metadata())
    return a, b, c, pb, pc


def raw_done(rid: str, sender: bytes, pages: int = 0, nbytes: int = 0) -> bytes:
    """A DONE of all layers of tokens [0, TOKENS), written by hand."""
    return encode_message(
        Message(Kind.DONE, sender, rid, 0, TOKENS, 0, SMALL.num_layers, nbytes, offset=pages)
    )


def send_raw(frm: ucx.UcxAgent, peer: Any, data: bytes) -> None:
    """Put bytes on the wire of ``frm``'s endpoint to ``peer`` as they are."""
    frm._engine.send(peer._ep, data, False)


async def settle() -> None:
    await asyncio.sleep(0.3)


async def close_all(*agents: ucx.UcxAgent) -> None:
    for x in agents:
        await x.close()


@pytest.mark.parametrize("early", [True, False], ids=["done_first", "expect_first"])
def test_a_done_from_an_agent_without_the_key_is_dropped(early: bool) -> None:
    async def body() -> None:
        a = agent(1)
        x = agent(4, psk=b"not the key, also thirty-two b.")
        with pytest.raises(AuthenticationError):
            await x.connect(a.metadata(), timeout=5)
        assert a.stats()["hello_refused"] == 1 and not a.peers
        # X writes a DONE of ucx.md's wire format anyway, over an endpoint of its own,
        # naming itself and then the receiver as the sender
        from kvbridge.transport.ucx.metadata import decode_metadata

        md = decode_metadata(a.metadata())
        ep = x._engine.connect(md.address, [(r.base, r.length, r.rkey) for r in md.regions], False)
        bt = np.array([5, 6])
        before = digest(cache_of(a), bt)
        h = None if early else a.expect("r", bt, 0, TOKENS)
        for who in (x.agent_id, a.agent_id):
            x._engine.send(ep, raw_done("r", who, nbytes=1 << 21), False)
        await settle()
        if early:
            h = a.expect("r", bt, 0, TOKENS, timeout=0.5)
            await settle()
        assert h is not None and not h.done()
        assert a.stats()["dropped_unknown_sender"] == 2
        assert digest(cache_of(a), bt) == before
        h.cancel()
        await close_all(a, x)

    run(body)


def test_a_done_naming_another_peer_as_sender_is_dropped() -> None:
    async def body() -> None:
        a, b, c, pb, pc = await trio()
        bt = np.array([7, 8])
        before = digest(cache_of(a), bt)
        pa_c = a.peer(c.agent_id)
        h = a.expect("r", bt, 0, TOKENS, peer=pa_c)  # bound to C
        # B writes C's agent id (and then the tag C was given, which B cannot
        # know: here a guess) into the sender field
        send_raw(b, pb, raw_done("r", c.agent_id))
        send_raw(b, pb, raw_done("r", bytes(16)))
        await settle()
        assert not h.done() and a.stats()["dropped_unknown_sender"] == 2
        # under its own tag, B's DONE is another peer's part: dropped, counted
        own = pb._tx_tag
        send_raw(b, pb, raw_done("r", own))
        await settle()
        assert not h.done() and a.stats()["done_wrong_peer"] == 1
        assert digest(cache_of(a), bt) == before
        # C's own put completes it
        sbt = np.array([1, 2])
        await pc.send("r", sbt, bt, 0, TOKENS)
        await h
        assert digest(cache_of(a), bt) == digest(cache_of(c), sbt)
        await close_all(a, b, c)

    run(body)


@pytest.mark.parametrize("early", [True, False], ids=["done_first", "expect_first"])
def test_a_put_into_other_pages_fails_the_expect(early: bool) -> None:
    async def body() -> None:
        a, b, c, pb, _pc = await trio()
        bt = np.array([10, 11])
        shifted = bt + 20  # B's remote block table: other pages of A
        before = digest(cache_of(a), bt)
        h = None if early else a.expect("r", bt, 0, TOKENS)
        await pb.send("r", np.array([3, 4]), shifted, 0, TOKENS)  # public API, an honest put
        await settle()
        if early:
            h = a.expect("r", bt, 0, TOKENS)
        assert h is not None
        with pytest.raises(RemoteProtocolError, match="other pages"):
            await h
        assert a.stats()["done_wrong_pages"] == 1
        assert digest(cache_of(a), bt) == before  # nothing landed in the expected pages
        assert digest(cache_of(a), shifted) == digest(cache_of(b), np.array([3, 4]))
        await close_all(a, b, c)

    run(body)


def test_a_done_with_nothing_put_names_its_pages_or_is_refused() -> None:
    """A DONE of an authenticated peer under its own tag but naming no pages
    (or a guess) fails the expect of these pages."""

    async def body() -> None:
        a, b, c, pb, _pc = await trio()
        bt = np.array([12, 13])
        before = digest(cache_of(a), bt)
        h = a.expect("r", bt, 0, TOKENS)
        send_raw(b, pb, raw_done("r", pb._tx_tag, pages=12345))
        with pytest.raises(RemoteProtocolError):
            await h
        assert a.stats()["done_wrong_pages"] == 1
        assert digest(cache_of(a), bt) == before
        await close_all(a, b, c)

    run(body)


def test_an_honest_transfer_lands_byte_for_byte() -> None:
    async def body() -> None:
        a, b, c, pb, _pc = await trio()
        rng = np.random.default_rng(0)
        for i in range(4):
            sbt = rng.permutation(PAGES)[:2]
            bt = rng.permutation(PAGES)[:2]
            h = a.expect(f"r{i}", bt, 0, TOKENS)
            path = "staging" if i % 2 else None
            await pb.send(f"r{i}", sbt, bt, 0, TOKENS, path=path)
            st = await h
            assert st.bytes == SMALL.wire_nbytes(TOKENS)
            assert digest(cache_of(a), bt) == digest(cache_of(b), sbt)
        assert all(v == 0 for v in a.stats().values()), a.stats()
        await close_all(a, b, c)

    run(body)


def test_what_one_peer_keeps_waiting_is_bounded() -> None:
    async def body() -> None:
        a, b, c, pb, pc = await trio()
        extra = 40
        for i in range(MAX_EARLY_PER_PEER + extra):
            send_raw(b, pb, raw_done(f"f{i}", pb._tx_tag))
            if i % 256 == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        assert a.stats()["early_dropped"] == extra
        assert a.peer(b.agent_id)._early_parts == MAX_EARLY_PER_PEER
        # another peer's early part is still kept, and lands
        bt, sbt = np.array([30, 31]), np.array([1, 2])
        await pc.send("c1", sbt, bt, 0, TOKENS)
        await settle()
        assert a.stats()["early_dropped"] == extra
        await a.expect("c1", bt, 0, TOKENS)
        assert digest(cache_of(a), bt) == digest(cache_of(c), sbt)
        # B's waiting parts go with B
        await b.close()
        await settle()
        assert b.agent_id not in {p.agent_id for p in a.peers}
        await close_all(a, c)

    run(body)


def test_a_dead_peer_leaves_the_peers() -> None:
    async def body() -> None:
        a = agent(1, heartbeat=0.2, peer_timeout=1.0)
        b, c = agent(2), agent(3)
        await b.connect(a.metadata())
        await c.connect(a.metadata())
        await settle()
        assert {p.agent_id for p in a.peers} == {b.agent_id, c.agent_id}
        gone = a.peer(b.agent_id)
        await b.close()  # says BYE
        await settle()
        assert [p.agent_id for p in a.peers] == [c.agent_id]
        assert gone.error is not None
        # C stops without a word (its worker goes, as in a crash): its
        # endpoint fails or the heartbeat finds it silent
        c._closed = True
        if c._progress is not None:
            c._progress.close()
        if c._hb_timer is not None:
            c._hb_timer.cancel()
        c._engine.close()
        await asyncio.sleep(2.0)
        assert a.peers == []
        c._deadlines.close()
        await a.close()

    run(body)
