"""The sender's connections to one receiver: opened, handshaken, re-opened.

:class:`LinkPool` keeps up to ``streams`` handshaken connections
(:class:`Link`).  A lost one is re-opened in the background with a capped
backoff for as long as transfers need it; transfers themselves decide when
they have waited too long without any connection (``reconnect_timeout``,
counted by each transfer from the moment it last had a usable connection:
:class:`kvbridge.wire.txtransfer.TxTransfer`).  A handshake that the receiver
refuses for good (wrong key, identity, layout, version) is not retried.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as _ssl
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import (
    AuthenticationError,
    IncompatiblePeer,
    KVBridgeError,
    PeerGone,
    ResourceLimit,
    VersionMismatch,
)
from ...wire.connection import TxConnection
from ...wire.frames import ALL_CAPABILITIES, Capability, Message
from ...wire.handshake import ClientHandshake
from ...wire.txtransfer import LinkClock
from .conn import FrameConnection, connect

log = logging.getLogger("kvbridge.transport")

__all__ = ["FATAL_HANDSHAKE", "Link", "LinkPool"]

# refusals that another attempt would only repeat
FATAL_HANDSHAKE = (AuthenticationError, IncompatiblePeer, VersionMismatch)
MAX_BACKOFF_S = 1.0


class Link:
    """One handshaken connection of a sender; its rules (transfer ids, what
    the receiver may send on it) are the sans-IO :class:`TxConnection`."""

    def __init__(self, conn: FrameConnection, ranged: bool) -> None:
        self.conn = conn
        self.ranged = ranged  # both peers announced RANGES (docs/protocol.md 5.9)
        self.rules: TxConnection[Any] = TxConnection()
        self.writer: asyncio.Task[None] | None = None
        self.idle = False  # its writer waits for a chunk and prepares none
        # the replies on it tell which chunks were lost (wire.txtransfer.LinkClock)
        self.clock = LinkClock(asyncio.get_running_loop().time())

    @property
    def closed(self) -> bool:
        return self.conn.closed

    @property
    def tids(self) -> dict[int, Any]:
        """Transfer id -> the transfer it names on this connection."""
        return self.rules.transfers

    def new_tid(self) -> int:
        return self.rules.new_tid()


class LinkPool:
    """``streams`` connections to ``host:port``, kept up while needed."""

    def __init__(
        self,
        host: str,
        port: int,
        streams: int,
        *,
        handshake: Callable[[], ClientHandshake],
        ssl: _ssl.SSLContext | None,
        server_hostname: str | None,
        connect_timeout: float,
        handshake_timeout: float,
        keepalive_interval: float,
        keepalive_timeout: float,
        reconnect_timeout: float,
        write_high: int,
        on_up: Callable[[Link], None],
        on_lost: Callable[[Link, KVBridgeError | None], None],
        on_message: Callable[[Link, Message], None],
        on_fatal: Callable[[KVBridgeError], None],
        busy: Callable[[], bool],
    ) -> None:
        self.host, self.port, self.streams = host, port, streams
        self._handshake = handshake
        self._ssl = ssl
        self._server_hostname = server_hostname
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.reconnect_timeout = reconnect_timeout
        self.write_high = write_high
        self._on_up, self._on_lost, self._on_message = on_up, on_lost, on_message
        self._on_fatal, self._busy = on_fatal, busy
        self.links: list[Link] = []
        self.peer_caps = ALL_CAPABILITIES
        self.peer_max_frame = 0
        self.connected = False
        self.closing = False
        self._lock = asyncio.Lock()
        self._reconnector: asyncio.Task[None] | None = None
        self.stats: dict[str, int] = {"connects": 0, "reconnects": 0, "connection_losses": 0}

    def __iter__(self) -> Iterator[Link]:
        return iter(list(self.links))

    def __len__(self) -> int:
        return len(self.links)

    def __getitem__(self, i: int) -> Link:
        return self.links[i]

    @property
    def live(self) -> list[Link]:
        return [lk for lk in self.links if not lk.closed]

    async def connect(self) -> None:
        """Open the connections (idempotent).  Raises the handshake's typed
        error at once for a refusal, else ConnectTimeout or PeerGone when not
        one connection succeeds within ``connect_timeout``."""
        async with self._lock:
            if self.connected:
                return
            deadline = time.monotonic() + self.connect_timeout
            delay = 0.02
            while True:
                results = await asyncio.gather(
                    *(self._open() for _ in range(self.streams - len(self.links))),
                    return_exceptions=True,
                )
                errors = [r for r in results if isinstance(r, BaseException)]
                if len(errors) < len(results) or self.links:
                    break
                fatal = [e for e in errors if isinstance(e, FATAL_HANDSHAKE)]
                if fatal:
                    raise fatal[0]
                if time.monotonic() + delay > deadline or self.closing:
                    raise errors[0]
                await asyncio.sleep(delay)  # transient (refused, reset): retry until the deadline
                delay = min(2 * delay, 0.5)
            self.connected = True
            if errors:
                self.ensure()

    async def _open(self) -> Link:
        hs = self._handshake()
        conn = await connect(
            self.host,
            self.port,
            hs,
            ssl=self._ssl,
            server_hostname=self._server_hostname,
            connect_timeout=self.connect_timeout,
            handshake_timeout=self.handshake_timeout,
            keepalive_interval=self.keepalive_interval,
            keepalive_timeout=self.keepalive_timeout,
        )
        assert hs.peer is not None
        if self.closing:
            conn.close()
            raise PeerGone("sender closed")
        ranged = bool(hs.peer.capabilities & hs.capabilities & Capability.RANGES)
        link = Link(conn, ranged)
        self.peer_caps = hs.peer.capabilities
        self.peer_max_frame = hs.peer.max_frame
        conn.set_write_limits(self.write_high)
        conn.on_close.append(lambda c, e: self._lost(link, e))
        conn.start(hs.peer, lambda c, m: self._on_message(link, m))
        self.links.append(link)
        self.stats["connects"] += 1
        self._on_up(link)
        return link

    def _lost(self, link: Link, err: KVBridgeError | None) -> None:
        if link in self.links:
            self.links.remove(link)
        self.stats["connection_losses"] += 1
        self._on_lost(link, err)
        if not self.closing:
            log.info("connection lost (%s); %d left", err, len(self.live))
            self.ensure()

    def ensure(self) -> None:
        """Re-open missing connections in the background (if not already)."""
        if self.closing or len(self.links) >= self.streams:
            return
        if self._reconnector is None or self._reconnector.done():
            self._reconnector = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = 0.05
        failing_since = time.monotonic()
        while not self.closing and len(self.links) < self.streams:
            try:
                await self._open()
                self.stats["reconnects"] += 1
                delay, failing_since = 0.05, time.monotonic()
                continue
            except FATAL_HANDSHAKE as e:
                if not self.live:
                    self._on_fatal(e)
                return
            except ResourceLimit:
                if self.live:
                    return  # the receiver takes no more of ours: keep the ones we have
            except KVBridgeError:
                pass
            # nothing needs connections and none could be made for a while: stop
            # (the next send starts again)
            idle = not self._busy()
            if idle and time.monotonic() - failing_since > self.reconnect_timeout:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)

    async def close(self) -> None:
        self.closing = True
        if self._reconnector is not None:
            self._reconnector.cancel()
        for link in list(self.links):
            if link.writer is not None:
                link.writer.cancel()
            link.conn.close()
        waits = [lk.writer for lk in self.links if lk.writer is not None]
        await asyncio.gather(*waits, return_exceptions=True)
        if self._reconnector is not None:
            await asyncio.gather(self._reconnector, return_exceptions=True)
        for link in list(self.links):
            try:
                await asyncio.wait_for(link.conn.wait_closed(), 2.0)
            except TimeoutError:
                link.conn.abort_transport()
