"""Helpers for the TCP transport tests: a loop runner with a deadline, a
frame-aware fault proxy, a sender whose second DATA body is damaged on the
way, a write-once sink, throwaway TLS certificates."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import subprocess
import traceback
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from kvbridge.transport.tcp import run
from kvbridge.transport.tcp.kvio import BytesSink

T = TypeVar("T")
HDR = struct.Struct("<IBBHI")
DATA_TYPE = 0x12


def arun(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    """Run ``coro`` on a fresh uvloop loop with a hard deadline."""

    async def guarded() -> T:
        try:
            return await asyncio.wait_for(coro, timeout)
        except BaseException:
            traceback.print_exc()  # shown even if closing the loop then gets stuck
            raise

    return run(guarded())


class OnceSink(BytesSink):
    """A sink that fails the test if any byte is written twice.  It offers no
    ``view``, so every chunk goes through ``write`` (see PlacedSink)."""

    view = None  # type: ignore[assignment]

    def __init__(self, nbytes: int, **kw: Any) -> None:
        super().__init__(nbytes, **kw)
        self.spans: list[tuple[int, int]] = []

    def write(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        for a, b in self.spans:
            assert end <= a or offset >= b, f"bytes [{offset}, {end}) written twice"
        self.spans.append((offset, end))
        super().write(offset, data)


async def damaged_second_chunk(rx: Any, chunk_size: int) -> tuple[Any, Any]:
    """A one-stream sender to ``rx`` through the emulator's fault proxy, which
    damages the body of the second DATA frame of the first connection;
    returns (proxy, sender).  The caller closes both."""
    from kvbridge.transport.tcp import TcpSender
    from kvbridge_bench.sim.emulator import CorruptFrame
    from kvbridge_bench.sim.emulator import FaultProxy as EmulatorFaultProxy

    proxy = EmulatorFaultProxy(
        ("127.0.0.1", rx.port), [CorruptFrame("body", frames=[1], conns=[0])]
    )
    await proxy.start()
    host, port = proxy.listen_addr
    tx = TcpSender(host, port, streams=1, chunk_size=chunk_size, compression="off")
    return proxy, tx


class FaultProxy:
    """A TCP proxy in front of a receiver.  Client-to-server traffic is parsed
    as frames so that faults hit exact places:

    * ``reset_after[i]``: connection ``i`` (in accept order) is aborted after
      that many client bytes (mid-frame if it falls there); ``None`` = never;
    * ``corrupt``: indices (counted over all connections) of DATA frames whose
      last payload byte is flipped;
    * ``stall``: when set, client bytes stop flowing (a silent peer).
    """

    def __init__(
        self,
        target_port: int,
        *,
        reset_after: list[int | None] | None = None,
        corrupt: set[int] | None = None,
    ) -> None:
        self.target_port = target_port
        self.reset_after = list(reset_after or [])
        self.corrupt = set(corrupt or ())
        self.stall = False
        self.data_frames = 0
        self.connections = 0
        self.resets = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        idx = self.connections
        self.connections += 1
        limit = self.reset_after[idx] if idx < len(self.reset_after) else None
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cw.transport.abort()
            return
        self._writers += [cw, sw]
        loop = asyncio.get_running_loop()
        up = loop.create_task(self._c2s(cr, sw, cw, limit))
        down = loop.create_task(self._s2c(sr, cw))
        self._tasks |= {up, down}
        await asyncio.gather(up, down, return_exceptions=True)
        self._tasks -= {up, down}
        for w in (cw, sw):
            w.transport.abort()

    async def _c2s(
        self,
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        limit: int | None,
    ) -> None:
        sent = 0
        try:
            while True:
                head = await r.readexactly(HDR.size)
                _, _, ftype, _, length = HDR.unpack(head)
                payload = bytearray(await r.readexactly(length))
                if ftype == DATA_TYPE:
                    if self.data_frames in self.corrupt:
                        payload[-1] ^= 0x01
                    self.data_frames += 1
                while self.stall:
                    await asyncio.sleep(0.01)
                frame = head + payload
                if limit is not None and sent + len(frame) > limit:
                    w.write(frame[: limit - sent])
                    with contextlib.suppress(ConnectionError):
                        await w.drain()
                    self.resets += 1
                    w.transport.abort()
                    client.transport.abort()
                    return
                w.write(frame)
                sent += len(frame)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.transport.abort()

    async def _s2c(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(1 << 16):
                w.write(data)
                await w.drain()
        except ConnectionError:
            pass
        w.transport.abort()


def make_certs(d: Path) -> dict[str, Path]:
    """A throwaway CA and server/client certificates (openssl CLI)."""

    def sh(*args: str) -> None:
        subprocess.run(args, check=True, capture_output=True, cwd=d)

    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
       "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=kvbridge-test-ca")  # fmt: skip
    for name in ("server", "client", "rogue", "prefill-0", "prefill-1"):
        sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
           "-out", f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
        san = "DNS:localhost,IP:127.0.0.1"
        if name.startswith("prefill-"):  # identities bound to certificates (security.md)
            n = name[-1]
            san = f"DNS:pf{n}.example,URI:spiffe://kvbridge/prefill-{n}"
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        if name == "rogue":  # self-signed: not from our CA
            sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-signkey", f"{name}.key",
               "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext")  # fmt: skip
        else:
            sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey",
               "ca.key", "-CAcreateserial", "-days", "2", "-out", f"{name}.pem",
               "-extfile", f"{name}.ext")  # fmt: skip
    out = {p.stem: p for p in d.glob("*.pem")}
    out.update({p.stem + "_key": p for p in d.glob("*.key")})
    return out


class PlacedSink(BytesSink):
    """A sink that lends its memory (``view``): the receiver reads chunks from
    the socket straight into it.  Records every view handed out."""

    def __init__(self, nbytes: int, **kw: Any) -> None:
        super().__init__(nbytes, **kw)
        self.views: list[tuple[int, int]] = []

    def view(self, offset: int, n: int) -> memoryview:
        self.views.append((offset, offset + n))
        return super().view(offset, n)
