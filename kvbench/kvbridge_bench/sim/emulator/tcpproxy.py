"""The asyncio TCP proxy that ProxyEmulator and FaultProxy are built on:
listen, accept, connect to the target, hand both ends to a subclass, and on
close abort every connection and wait for every task."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
import struct
from typing import Any

from kvbridge.errors import InvalidArgument, map_os_error

Addr = tuple[str, int]


def parse_hostport(text: str) -> Addr:
    """``"127.0.0.1:9000"`` -> ``("127.0.0.1", 9000)``; ``"[::1]:9000"`` too."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    p = int(port)
    if p > 65535:
        raise InvalidArgument(f"port out of range in {text!r}")
    return host, p


def abort_with_rst(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy(abc.ABC):
    """Accepts on ``listen`` and connects each client to ``target``."""

    def __init__(
        self, target: Addr, listen: Addr = ("127.0.0.1", 0), connect_timeout_s: float = 10.0
    ) -> None:
        self.target = (str(target[0]), int(target[1]))
        self.listen = (str(listen[0]), int(listen[1]))
        self.connect_timeout_s = connect_timeout_s
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._accepted = 0
        self.connect_failures = 0

    @property
    def listen_addr(self) -> Addr:
        """The bound (host, port); valid after :meth:`start`."""
        if self._server is None:
            raise InvalidArgument("the proxy is not started")
        name = self._server.sockets[0].getsockname()
        return str(name[0]), int(name[1])

    async def start(self) -> TcpProxy:
        if self._server is not None:
            raise InvalidArgument("the proxy is already started")
        self._server = await asyncio.start_server(self._on_accept, *self.listen)
        return self

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> TcpProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    def _track(self, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self._accepted
        self._accepted += 1
        task = asyncio.get_running_loop().create_task(self._run(index, reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, index: int, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter
    ) -> None:
        self._track(c_writer)
        writers: list[asyncio.StreamWriter] = [c_writer]
        try:
            if not await self.on_accept(index, c_writer):
                return
            try:
                s_reader, s_writer = await asyncio.wait_for(
                    asyncio.open_connection(*self.target), self.connect_timeout_s
                )
            except (TimeoutError, OSError) as exc:
                self.on_connect_failed(index, map_os_error(exc, "connect"))
                abort_with_rst(c_writer)
                return
            self._track(s_writer)
            writers.append(s_writer)
            await self.handle(index, c_reader, c_writer, s_reader, s_writer)
        finally:
            for w in writers:
                self._writers.discard(w)
                if not w.transport.is_closing():
                    w.transport.abort()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    # --- for subclasses ------------------------------------------------------
    async def on_accept(self, index: int, c_writer: asyncio.StreamWriter) -> bool:
        """Return False to refuse connection ``index`` (it is then closed)."""
        return True

    def on_connect_failed(self, index: int, exc: BaseException) -> None:
        """The target refused or did not answer; the client is reset."""
        self.connect_failures += 1

    @abc.abstractmethod
    async def handle(
        self,
        index: int,
        c_reader: asyncio.StreamReader,
        c_writer: asyncio.StreamWriter,
        s_reader: asyncio.StreamReader,
        s_writer: asyncio.StreamWriter,
    ) -> None:
        """Move bytes between the client (c_*) and the target (s_*) until done."""
