"""FaultProxy: every fault, its connection selection and its counters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge_bench.sim.emulator import (
    Blackhole,
    CorruptFrame,
    DropAtAccept,
    FaultProxy,
    FlipBits,
    HalfClose,
    ResetAfter,
    Stall,
)
from kvbridge_bench.sim.emulator.faults import FRAME_FIELDS


def run(coro: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


@dataclass
class Conn:
    data: bytearray = field(default_factory=bytearray)
    times: list[float] = field(default_factory=list)
    end: str = "open"
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Sink:
    """A target that records what each connection delivered and how it ended;
    with ``reply`` it answers every connection with those bytes first."""

    def __init__(self, reply: bytes = b"") -> None:
        self.conns: list[Conn] = []
        self.reply = reply
        self._srv: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> tuple[str, int]:
        self._srv = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._srv.sockets[0].getsockname()[:2]  # type: ignore[no-any-return]

    async def __aexit__(self, *exc: object) -> None:
        assert self._srv is not None
        self._srv.close()
        await self._srv.wait_closed()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = Conn()
        self.conns.append(conn)
        try:
            if self.reply:
                w.write(self.reply)
                await w.drain()
            while data := await r.read(65536):
                conn.times.append(time.monotonic())
                conn.data.extend(data)
            conn.end = "eof"
        except ConnectionResetError:
            conn.end = "reset"
        finally:
            conn.done.set()
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()


async def send_all(addr: tuple[str, int], payload: bytes) -> str:
    """Send payload, half-close, read to the end; say how it ended."""
    r, w = await asyncio.open_connection(*addr)
    try:
        w.write(payload)
        await w.drain()
        w.write_eof()
        await r.read(-1)
        return "eof"
    except ConnectionError:
        return "reset"
    finally:
        w.close()
        with contextlib.suppress(OSError):
            await w.wait_closed()


def test_reset_after_n_bytes_only_on_the_chosen_connection() -> None:
    payload = os.urandom(1 << 20)
    sink = Sink()

    async def main() -> None:
        async with sink as target, FaultProxy(target) as proxy:
            proxy.add(ResetAfter(100_000, conns=[0]))
            assert await send_all(proxy.listen_addr, payload) == "reset"
            assert await send_all(proxy.listen_addr, payload) == "eof"
            await asyncio.wait_for(sink.conns[0].done.wait(), 5)
            await asyncio.wait_for(sink.conns[1].done.wait(), 5)
            assert proxy.stats.resets == 1
            assert proxy.stats.events[0] == (0, "reset", "c2s", 100_000)

    run(main())
    first, second = sink.conns
    assert first.end == "reset"
    assert bytes(first.data) == payload[:100_000]  # exactly N bytes, then the reset
    assert second.end == "eof" and bytes(second.data) == payload


def test_reset_in_server_to_client_direction() -> None:
    reply = os.urandom(50_000)
    sink = Sink(reply=reply)

    async def main() -> None:
        async with sink as target, FaultProxy(target, [ResetAfter(20_000, direction="s2c")]) as p:
            r, w = await asyncio.open_connection(*p.listen_addr)
            got = bytearray()
            with pytest.raises(ConnectionResetError):
                while data := await r.read(65536):
                    got.extend(data)
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
            assert len(got) <= 20_000 and bytes(got) == reply[: len(got)]
            assert p.stats.resets == 1

    run(main())


def test_stall_for_a_while_then_resume() -> None:
    payload = os.urandom(200_000)
    sink = Sink()

    async def main() -> None:
        async with sink as target, FaultProxy(target, [Stall(after=50_000, seconds=0.4)]) as p:
            assert await send_all(p.listen_addr, payload) == "eof"
            assert p.stats.stalls == 1

    run(main())
    conn = sink.conns[0]
    assert bytes(conn.data) == payload
    # the largest gap between deliveries is the stall (a lower bound only)
    gaps = [b - a for a, b in zip(conn.times, conn.times[1:], strict=False)]
    assert max(gaps) >= 0.4 - 0.01


def test_stall_forever_holds_the_connection_open() -> None:
    payload = os.urandom(100_000)
    sink = Sink()

    async def main() -> None:
        async with sink as target, FaultProxy(target, [Stall(after=30_000)]) as p:
            _r, w = await asyncio.open_connection(*p.listen_addr)
            w.write(payload)
            await w.drain()
            for _ in range(100):
                if sink.conns and len(sink.conns[0].data) >= 30_000:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            assert len(sink.conns[0].data) == 30_000
            assert sink.conns[0].end == "open"
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()

    run(main())


def test_flip_one_bit_at_offset() -> None:
    payload = os.urandom(300_000)
    sink = Sink()

    async def main() -> None:
        async with sink as target, FaultProxy(target, [FlipBits(offset=123_457, mask=0x10)]) as p:
            assert await send_all(p.listen_addr, payload) == "eof"
            assert p.stats.bits_flipped == 1

    run(main())
    got = bytes(sink.conns[0].data)
    assert len(got) == len(payload)
    diff = [i for i in range(len(got)) if got[i] != payload[i]]
    assert diff == [123_457]
    assert got[123_457] ^ payload[123_457] == 0x10


def test_flip_with_probability_matches_counters() -> None:
    payload = bytes(400_000)
    sink = Sink()

    async def main() -> None:
        async with sink as target, FaultProxy(target, [FlipBits(probability=1e-4, seed=7)]) as p:
            assert await send_all(p.listen_addr, payload) == "eof"
            flips = [e[3] for e in p.stats.events if e[1] == "flip"]
            got = bytes(sink.conns[0].data)
            diff = [i for i, b in enumerate(got) if b]
            assert diff == flips
            assert p.stats.bits_flipped == len(flips) == sum(bin(got[i]).count("1") for i in diff)
            assert 10 < len(flips) < 90  # about 40 expected

    run(main())


def test_drop_at_accept_then_accept_the_next() -> None:
    sink = Sink()

    async def main() -> None:
        async with sink as target, FaultProxy(target) as p:
            p.set_faults([DropAtAccept(conns=0)])
            assert await send_all(p.listen_addr, b"hello") == "reset"
            assert await send_all(p.listen_addr, b"world") == "eof"
            assert p.stats.accepted == 2 and p.stats.dropped_at_accept == 1

    run(main())
    assert len(sink.conns) == 1 and bytes(sink.conns[0].data) == b"world"


def test_fault_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        FlipBits()
    with pytest.raises(InvalidArgument):
        FlipBits(offset=1, probability=0.1)
    with pytest.raises(InvalidArgument):
        FlipBits(offset=1, mask=0)
    with pytest.raises(InvalidArgument):
        ResetAfter(-1)
    with pytest.raises(InvalidArgument):
        Stall(direction="up")
    assert ResetAfter(1, conns=3).applies(3) and not ResetAfter(1, conns=3).applies(2)
    assert Stall(conns=None).applies(99)


# ---- frame faults, half-closes, blackholes, resets on demand ---------------------------------
def _frames(n: int) -> list[bytes]:
    from kvbridge.wire import encode_frame
    from kvbridge.wire.chunk import checksum
    from kvbridge.wire.frames import Control, Data

    out = [encode_frame(Control(0x41, 0, b"not DATA"))]
    for i in range(n):
        body = os.urandom(1000 + i)
        out.append(encode_frame(Data(7, i, i * 4096, len(body), 0, 0, checksum(body), body)))
    return out


@pytest.mark.parametrize("field", sorted(FRAME_FIELDS))
def test_corrupt_frame_flips_one_bit_of_the_field_of_the_chosen_frame(field: str) -> None:
    frames = _frames(5)
    sink = Sink()

    async def main() -> None:
        fault = CorruptFrame(field, frames=[2], seed=3)
        async with sink as target, FaultProxy(target, [fault]) as p:
            assert await send_all(p.listen_addr, b"".join(frames)) == "eof"
            assert p.stats.frames_corrupted == 1 and p.stats.bits_flipped == 1

    run(main())
    got = bytes(sink.conns[0].data)
    sent = b"".join(frames)
    diff = [i for i in range(len(sent)) if got[i] != sent[i]]
    assert len(diff) == 1 and bin(got[diff[0]] ^ sent[diff[0]]).count("1") == 1
    start = sum(len(f) for f in frames[:3])  # the CONTROL frame, DATA 0 and DATA 1 come first
    a, b = FRAME_FIELDS[field]
    if field == "body":
        a, b = len(frames[3]) - (1002), len(frames[3])
    assert start + a <= diff[0] < start + b


def test_corrupt_frame_by_probability_is_reproducible() -> None:
    frames = b"".join(_frames(200))
    got: list[bytes] = []

    async def main() -> None:
        for _ in range(2):
            sink = Sink()
            async with (
                sink as target,
                FaultProxy(target, [CorruptFrame("seq", probability=0.1, seed=11)]) as p,
            ):
                assert await send_all(p.listen_addr, frames) == "eof"
                assert 5 < p.stats.frames_corrupted < 45
            got.append(bytes(sink.conns[0].data))

    run(main())
    assert got[0] == got[1] != frames


def test_half_close_ends_one_direction_only() -> None:
    reply = os.urandom(30_000)
    sink = Sink(reply=reply)
    payload = os.urandom(100_000)

    async def main() -> None:
        async with sink as target, FaultProxy(target, [HalfClose(after=40_000)]) as p:
            r, w = await asyncio.open_connection(*p.listen_addr)
            w.write(payload)
            await w.drain()
            got = await asyncio.wait_for(r.readexactly(len(reply)), 5)
            assert got == reply  # the other direction flows on
            await asyncio.wait_for(sink.conns[0].done.wait(), 5)
            assert p.stats.half_closes == 1
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()

    run(main())
    assert sink.conns[0].end == "eof" and bytes(sink.conns[0].data) == payload[:40_000]


def test_blackhole_stops_both_directions_and_keeps_the_connection_open() -> None:
    sink = Sink(reply=b"")
    payload = os.urandom(100_000)

    async def main() -> None:
        async with sink as target, FaultProxy(target, [Blackhole(after=20_000)]) as p:
            r, w = await asyncio.open_connection(*p.listen_addr)
            w.write(payload)
            await w.drain()
            await asyncio.sleep(0.3)
            assert len(sink.conns[0].data) == 20_000 and sink.conns[0].end == "open"
            assert p.stats.blackholes == 1
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(r.read(1), 0.2)  # nothing comes back, no EOF either
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()

    run(main())


def test_reset_now_hits_the_live_connection_it_names() -> None:
    sink = Sink()

    async def main() -> None:
        async with sink as target, FaultProxy(target) as p:
            conns = [await asyncio.open_connection(*p.listen_addr) for _ in range(2)]
            for _, w in conns:
                w.write(b"x")
                await w.drain()
            for _ in range(100):
                if len(p.live_connections) == 2:
                    break
                await asyncio.sleep(0.01)
            assert p.reset(1) == 1 and p.live_connections == [0]
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(conns[1][0].read(1), 5)
            assert p.reset() == 1 and p.stats.resets == 2
            for _, w in conns:
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()

    run(main())


def test_new_fault_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgument):
        CorruptFrame("flags", frames=[0])
    with pytest.raises(InvalidArgument):
        CorruptFrame("seq")
    with pytest.raises(InvalidArgument):
        CorruptFrame("seq", frames=[0], probability=0.5)
    with pytest.raises(InvalidArgument):
        HalfClose(after=-1)
    with pytest.raises(InvalidArgument):
        Blackhole(direction="sideways")
