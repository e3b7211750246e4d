"""The client's exactly-once merge."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import HandoffTimeout, InvalidArgument, RemoteProtocolError
from kvbridge.handoff import Source, StreamMerge, StreamTokens


def chunks(tokens: list[int], rng: random.Random) -> list[StreamTokens]:
    out, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, 4)
        src = Source.RELAY if i < len(tokens) // 2 else Source.MAIN
        out.append(StreamTokens(1, i, tuple(tokens[i : i + n]), src, i + n >= len(tokens)))
        i += n
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 99), min_size=1, max_size=60), st.integers(0, 2**32))
def test_every_token_once_in_order(tokens: list[int], seed: int) -> None:
    rng = random.Random(seed)
    msgs = chunks(tokens, rng)
    # duplicate some, overlap some (a re-sent range from 0), shuffle all
    msgs += rng.sample(msgs, k=len(msgs) // 2)
    msgs.append(StreamTokens(1, 0, tuple(tokens[: rng.randint(1, len(tokens))]), Source.MAIN))
    rng.shuffle(msgs)
    m = StreamMerge(1)
    delivered: list[int] = []
    for t, msg in enumerate(msgs):
        got = m.push(msg, float(t))
        assert got == m.tokens[len(delivered) :]
        delivered += got
    assert delivered == tokens and m.done and m.conflicts == 0
    assert m.duplicates == sum(len(x.tokens) for x in msgs) - len(tokens)


def test_gap_and_idle_deadlines() -> None:
    m = StreamMerge(1, gap_timeout=1.0, idle_timeout=5.0, now=0.0)
    assert m.push(StreamTokens(1, 0, (1,), Source.RELAY), 0.0) == [1]
    assert m.push(StreamTokens(1, 2, (3,), Source.RELAY), 0.5) == []
    assert m.next_deadline() == 1.5
    m.check(1.4)
    with pytest.raises(HandoffTimeout, match="token 1 missing"):
        m.check(1.5)
    assert m.push(StreamTokens(1, 1, (2,), Source.MAIN), 1.6) == [2, 3]
    m.check(6.5)
    with pytest.raises(HandoffTimeout, match="no token"):
        m.check(6.6)


def test_conflicts_counted_first_wins() -> None:
    m = StreamMerge(1)
    m.push(StreamTokens(1, 0, (1, 2), Source.RELAY), 0.0)
    m.push(StreamTokens(1, 1, (9,), Source.MAIN), 0.0)
    assert m.tokens == [1, 2] and m.conflicts == 1


def test_protocol_violations() -> None:
    m = StreamMerge(1, max_ahead=10)
    with pytest.raises(RemoteProtocolError):
        m.push(StreamTokens(1, 10, (1,), Source.RELAY), 0.0)
    m.push(StreamTokens(1, 0, (1, 2), Source.RELAY, last=True), 0.0)
    assert m.done
    with pytest.raises(RemoteProtocolError):
        m.push(StreamTokens(1, 0, (1, 2, 3), Source.MAIN, last=True), 0.0)
    with pytest.raises(InvalidArgument):
        m.push(StreamTokens(2, 0, (1,), Source.RELAY), 0.0)
    with pytest.raises(InvalidArgument):
        StreamMerge(1, gap_timeout=0)


def test_node_routes_early_messages_and_rejects_garbage() -> None:
    import asyncio

    from kvbridge.handoff import Ready, encode
    from kvbridge.handoff.node import MAX_EARLY_REQUESTS, HandoffNode
    from kvbridge_bench.sim.network import MemoryNetwork

    async def go() -> None:
        net = MemoryNetwork()
        a = net.node("a")
        async with HandoffNode(net.node("b"), poll_interval=0.01) as node:
            for rid in range(MAX_EARLY_REQUESTS + 5):  # more orphans than are kept
                await a.send("b", 0x40, encode(Ready(rid, 3, 1)))
            await a.send("b", 0x40, b"\x01\x40garbage")
            await a.send("b", 0x41, encode(Ready(7, 3, 1)))  # frame type does not match
            for _ in range(200):  # the pump drains the 1031 messages (2 s at most)
                if node.rejected == 2:
                    break
                await asyncio.sleep(0.01)
            assert node.rejected == 2
            assert node.open(0).empty()  # the oldest orphan was forgotten
            q = node.open(MAX_EARLY_REQUESTS + 4)
            assert q.get_nowait() == Ready(MAX_EARLY_REQUESTS + 4, 3, 1)
            await a.send("b", 0x40, encode(Ready(MAX_EARLY_REQUESTS + 4, 3, 2)))
            got = await asyncio.wait_for(q.get(), 2)
            assert got == Ready(MAX_EARLY_REQUESTS + 4, 3, 2)
        net.close()

    asyncio.run(asyncio.wait_for(go(), 10))
