"""The pluggable message channel of the handoff driver.

A channel moves opaque payloads tagged with their CONTROL frame type between
named nodes.  :class:`RoutedChannel` carries them over kvbridge's TCP
connections as CONTROL frames (what engines and the demo use);
:mod:`kvbridge_bench.sim.network` is an in-memory one with an emulated link, for
tests and benchmarks on one machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import PeerGone

__all__ = [
    "PEER_TYPES",
    "Datagram",
    "MessageChannel",
    "RoutedChannel",
]


@dataclass(frozen=True)
class Datagram:
    src: str
    frame_type: int
    payload: bytes


class MessageChannel(Protocol):
    """One node's end of a message channel."""

    name: str

    async def send(self, dst: str, frame_type: int, payload: bytes) -> None:
        """Queue a message for ``dst`` (returns once it is handed to the link)."""
        ...

    async def recv(self, timeout: float) -> Datagram | None:
        """The next message for this node, or None after ``timeout`` seconds."""
        ...


# the handoff messages that travel between relay and main decode
PEER_TYPES = (0x40, 0x41, 0x42, 0x43)  # READY, TOKENS, ACK, DONE

Route = Callable[[int, bytes], Awaitable[None] | None]


class RoutedChannel:
    """A :class:`MessageChannel` over whatever reaches each peer: the relay and
    the main decode talk through kvbridge's TCP connections as CONTROL frames
    (:meth:`link_sender`, :meth:`link_receiver`), the client through any
    callback (:meth:`route`).  Duck-typed on the transport: this module
    imports none."""

    def __init__(self, name: str, *, max_queue: int = 65536) -> None:
        self.name = name
        self._routes: dict[str, Route] = {}
        self._inbox: asyncio.Queue[Datagram] = asyncio.Queue(max_queue)
        self.dropped = 0

    def route(self, dst: str, fn: Route) -> None:
        """Messages for ``dst`` go to ``fn(frame_type, payload)``."""
        self._routes[dst] = fn

    def deliver(self, src: str, frame_type: int, payload: bytes) -> None:
        """A message from ``src`` arrived (called by the transport)."""
        try:
            self._inbox.put_nowait(Datagram(src, frame_type, bytes(payload)))
        except asyncio.QueueFull:
            self.dropped += 1  # the handoff is idempotent by position: a resend repairs it

    def link_sender(self, peer: str, sender: Any, types: tuple[int, ...] = PEER_TYPES) -> None:
        """``peer`` is the receiver that ``sender`` (a connected ``TcpSender``,
        e.g. ``PrefillBridge.tcp_sender(name)``) reaches."""
        for t in types:
            sender.on_control(t, lambda _conn, ft, p: self.deliver(peer, ft, p))
        self.route(peer, lambda ft, p: sender.send_control(ft, p))

    def link_receiver(
        self, peer: str, receiver: Any, identity: str, types: tuple[int, ...] = PEER_TYPES
    ) -> None:
        """``peer`` is the sender that connected to ``receiver`` (a
        ``TcpReceiver``, or a ``DecodeBridge``) and authenticated as
        ``identity``."""
        tcp = getattr(receiver, "tcp", receiver)
        for t in types:
            receiver.on_control(t, lambda _conn, ft, p: self.deliver(peer, ft, p))
        self.route(peer, lambda ft, p: tcp.send_control(identity, ft, p))

    async def send(self, dst: str, frame_type: int, payload: bytes) -> None:
        fn = self._routes.get(dst)
        if fn is None:
            raise PeerGone(f"{self.name}: no route to {dst!r}")
        res = fn(frame_type, payload)
        if res is not None:
            await res

    async def recv(self, timeout: float) -> Datagram | None:
        try:
            return await asyncio.wait_for(self._inbox.get(), max(timeout, 0.0))
        except TimeoutError:
            return None
