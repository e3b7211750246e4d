"""ProxyEmulator: the TCP-terminating fallback emulator (delay, rate, integrity)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge_bench.sim.emulator import LinkParams, ProxyEmulator

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(coro: Coroutine[Any, Any, None], timeout: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def server(handler: Handler) -> Any:
    async def wrapped(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await handler(r, w)
        finally:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()

    srv = await asyncio.start_server(wrapped, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[:2]
    finally:
        srv.close()
        await srv.wait_closed()


async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while data := await r.read(65536):
        w.write(data)
        await w.drain()


async def close(w: asyncio.StreamWriter) -> None:
    w.close()
    with contextlib.suppress(OSError):
        await w.wait_closed()


def test_ping_pong_sees_the_round_trip() -> None:
    async def main() -> None:
        async with (
            server(echo) as target,
            ProxyEmulator(target, rate_bps=1e9, rtt_ms=60) as proxy,
        ):
            r, w = await asyncio.open_connection(*proxy.listen_addr)
            rtts = []
            for _ in range(5):
                t0 = time.monotonic()
                w.write(b"p")
                assert await r.readexactly(1) == b"p"
                rtts.append(time.monotonic() - t0)
            await close(w)
        assert min(rtts) >= 0.060 - 0.002  # never faster than the configured RTT
        assert statistics.median(rtts) < 0.060 + 0.150  # loose: a busy machine is late

    run(main())


def test_rate_limit_and_integrity() -> None:
    rate = 8e6  # 1 MB/s
    payload = os.urandom(600_000)
    got = bytearray()
    times: list[float] = []

    async def sink(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            times.append(time.monotonic())
            got.extend(data)

    async def main() -> None:
        async with server(sink) as target, ProxyEmulator(target, rate_bps=rate, rtt_ms=10) as p:
            _, w = await asyncio.open_connection(*p.listen_addr)
            w.write(payload)
            await w.drain()
            w.write_eof()
            while len(got) < len(payload):
                await asyncio.sleep(0.02)
            await close(w)
            assert p.stats()["bytes_c2s"] == len(payload)

    run(main())
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    elapsed = times[-1] - times[0]
    # everything after the first delivered chunk crossed the line at <= rate
    assert len(payload) - 256 * 1024 <= rate / 8 * elapsed * 1.02


def test_both_directions_and_half_close() -> None:
    payload = os.urandom(300_000)

    async def main() -> None:
        async with (
            server(echo) as target,
            ProxyEmulator(
                target,
                c2s=LinkParams(rate_bps=5e7, delay_s=0.005),
                s2c=LinkParams(rate_bps=2e7, delay_s=0.015, jitter_s=0.002),
            ) as p,
        ):
            r, w = await asyncio.open_connection(*p.listen_addr)
            w.write(payload)
            await w.drain()
            w.write_eof()
            back = await r.read(-1)  # until the server's FIN came through
            await close(w)
            assert back == payload

    run(main())


def test_refused_target_resets_the_client() -> None:
    async def main() -> None:
        srv = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        async with ProxyEmulator(("127.0.0.1", port), rtt_ms=1) as p:
            r, w = await asyncio.open_connection(*p.listen_addr)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await r.readexactly(1)
            await close(w)
            assert p.connect_failures == 1

    run(main())


def test_proxy_rejects_loss_and_bad_args() -> None:
    with pytest.raises(InvalidArgument):
        ProxyEmulator(("127.0.0.1", 1), c2s=LinkParams(loss=0.01))
    with pytest.raises(InvalidArgument):
        ProxyEmulator(("127.0.0.1", 1), rtt_ms=-1)
    with pytest.raises(InvalidArgument):
        ProxyEmulator(("127.0.0.1", 1), window_bytes=0)
    with pytest.raises(InvalidArgument):
        _ = ProxyEmulator(("127.0.0.1", 1)).listen_addr
