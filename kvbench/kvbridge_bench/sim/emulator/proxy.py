"""ProxyEmulator: the fallback WAN emulator for machines without root.

A TCP-terminating asyncio proxy on loopback.  Bytes read from one side go
through a serializer at the line rate (shared by all connections of that
direction, like one line) and are written to the other side one-way delay
later.  Less faithful than :class:`~.wan.WanEmulator`: each endpoint's TCP
talks to the proxy over loopback and sees a short round trip, so window
limits, slow start and loss recovery over the long path are not emulated and
one stream fills the line as easily as eight.  Loss is not offered.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque

from kvbridge.errors import InvalidArgument

from .link import Link
from .params import LinkParams
from .tcpproxy import Addr, TcpProxy

READ_SIZE = 256 * 1024
MIN_WINDOW = 256 * 1024


class _Pipe:
    """One direction of one connection: read, schedule on the shared line,
    deliver when due; at most ``window`` bytes between read and written."""

    def __init__(self, line: Link, window: int, counter: list[int]) -> None:
        self.line = line
        self.window = window
        self.counter = counter
        self.held: deque[tuple[float, bytes]] = deque()
        self.inflight = 0
        self.eof = False
        self.space = asyncio.Event()
        self.data = asyncio.Event()

    async def feed(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.inflight >= self.window:
                self.space.clear()
                await self.space.wait()
            chunk = await reader.read(min(READ_SIZE, self.window - self.inflight))
            if not chunk:
                self.eof = True
                self.data.set()
                return
            due = self.line.offer(loop.time(), len(chunk))
            assert due is not None  # the proxy's line has no loss and no queue bound
            self.held.append((due, chunk))
            self.inflight += len(chunk)
            self.data.set()

    async def deliver(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.held:
                if self.eof:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                self.data.clear()
                await self.data.wait()
            due, chunk = self.held.popleft()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()
            self.inflight -= len(chunk)
            self.counter[0] += len(chunk)
            self.space.set()


class ProxyEmulator(TcpProxy):
    """``async with ProxyEmulator(target, rate_bps=1e9, rtt_ms=40) as p:``
    then connect to ``p.listen_addr`` instead of ``target``.

    ``c2s`` / ``s2c`` replace the parameters of one direction (client to
    server, server to client); their ``loss`` must be 0.  ``window_bytes``
    bounds the bytes held per connection and direction (default: one
    bandwidth-delay product of the round trip, at least 256 KiB).
    """

    def __init__(
        self,
        target: Addr,
        rate_bps: float = 1e9,
        rtt_ms: float = 40.0,
        *,
        jitter_ms: float = 0.0,
        listen: Addr = ("127.0.0.1", 0),
        c2s: LinkParams | None = None,
        s2c: LinkParams | None = None,
        window_bytes: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(target, listen)
        if not rtt_ms >= 0:
            raise InvalidArgument(f"rtt_ms must be >= 0, got {rtt_ms!r}")
        both = LinkParams(
            rate_bps=float(rate_bps), delay_s=rtt_ms / 2000, jitter_s=jitter_ms / 1000
        )
        self.c2s = c2s or both
        self.s2c = s2c or both
        for p in (self.c2s, self.s2c):
            if p.loss or p.reorder:
                raise InvalidArgument("ProxyEmulator has no loss or reordering (use WanEmulator)")
        rtt = self.c2s.delay_s + self.s2c.delay_s
        self._lines = {
            name: Link(p.with_(queue_bytes=1 << 62), 65536, rtt, random.Random(seed))
            for name, p in (("c2s", self.c2s), ("s2c", self.s2c))
        }
        if window_bytes is not None and window_bytes <= 0:
            raise InvalidArgument(f"window_bytes must be > 0, got {window_bytes}")
        self._windows = {
            name: window_bytes or max(MIN_WINDOW, int(p.rate_bps * rtt / 8))
            for name, p in (("c2s", self.c2s), ("s2c", self.s2c))
        }
        self._bytes = {"c2s": [0], "s2c": [0]}

    def stats(self) -> dict[str, int]:
        """Connections accepted and bytes delivered per direction."""
        return {
            "connections": self._accepted,
            "bytes_c2s": self._bytes["c2s"][0],
            "bytes_s2c": self._bytes["s2c"][0],
        }

    async def handle(
        self,
        index: int,
        c_reader: asyncio.StreamReader,
        c_writer: asyncio.StreamWriter,
        s_reader: asyncio.StreamReader,
        s_writer: asyncio.StreamWriter,
    ) -> None:
        up = _Pipe(self._lines["c2s"], self._windows["c2s"], self._bytes["c2s"])
        down = _Pipe(self._lines["s2c"], self._windows["s2c"], self._bytes["s2c"])
        tasks = [
            asyncio.ensure_future(coro)
            for coro in (
                up.feed(c_reader),
                up.deliver(s_writer),
                down.feed(s_reader),
                down.deliver(c_writer),
            )
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    return  # a reset on one side: the caller aborts both
            for w in (c_writer, s_writer):
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
