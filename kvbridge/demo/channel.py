"""A handoff :class:`~kvbridge.handoff.channel.MessageChannel` over the real
transports: messages to a peer decode travel as CONTROL frames on kvbridge's
TCP connections (across the emulated WAN); messages to the client go to a
callback (the demo forwards them to the driver)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..errors import PeerGone
from ..handoff.channel import Datagram

__all__ = ["RoleChannel"]

Route = Callable[[int, bytes], Awaitable[None] | None]


class RoleChannel:
    """One role's end: ``route(dst, fn)`` says how to reach ``dst``;
    ``deliver(src, type, payload)`` feeds what arrives from the transport."""

    def __init__(self, name: str, *, max_queue: int = 65536) -> None:
        self.name = name
        self._routes: dict[str, Route] = {}
        self._inbox: asyncio.Queue[Datagram] = asyncio.Queue(max_queue)
        self.dropped = 0

    def route(self, dst: str, fn: Route) -> None:
        self._routes[dst] = fn

    def deliver(self, src: str, frame_type: int, payload: bytes) -> None:
        try:
            self._inbox.put_nowait(Datagram(src, frame_type, bytes(payload)))
        except asyncio.QueueFull:
            self.dropped += 1  # the handoff is idempotent by position: a resend repairs it

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
