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
from kvbridge.sim.emulator import DropAtAccept, FaultProxy, FlipBits, ResetAfter, Stall


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
