"""The pluggable message channel of the handoff driver, and an in-memory
implementation with an emulated link (delay, jitter, rate, loss, duplicates,
reordering, segment loss with retransmission) for tests and benchmarks.

A channel moves opaque payloads tagged with their CONTROL frame type between
named nodes.  :class:`RoutedChannel` carries them over kvbridge's TCP
connections as CONTROL frames (what engines and the demo use); the in-memory
one is used by the tests and the bench on one machine.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidArgument, PeerGone

__all__ = [
    "PEER_TYPES",
    "Datagram",
    "LinkModel",
    "MemoryChannel",
    "MemoryNetwork",
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


@dataclass(frozen=True)
class LinkModel:
    """One direction of an emulated link.

    A message of ``n`` bytes waits for the link (``rate_bps``, 0: unlimited),
    then arrives after ``delay`` plus ``|N(0, jitter)|``.  It travels as
    ``ceil(n / segment_bytes)`` segments, each lost with ``segment_loss`` and
    retransmitted after ``rto`` (a reliable stream's tail latency).  Whole
    messages are lost with ``loss``, sent twice with ``duplicate`` and held
    back by ``reorder_delay`` with ``reorder`` (the fault injection of an
    unreliable path).
    """

    delay: float = 0.0
    jitter: float = 0.0
    rate_bps: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_delay: float = 0.005
    segment_bytes: int = 65536
    segment_loss: float = 0.0
    rto: float = 0.2

    def __post_init__(self) -> None:
        for p in (self.loss, self.duplicate, self.reorder, self.segment_loss):
            if not 0.0 <= p <= 1.0:
                raise InvalidArgument(f"probability {p} outside [0, 1]")
        if min(self.delay, self.jitter, self.rate_bps, self.reorder_delay, self.rto) < 0:
            raise InvalidArgument("link times and rates must be >= 0")
        if self.segment_bytes <= 0:
            raise InvalidArgument("segment_bytes must be positive")


class MemoryNetwork:
    """Named in-memory nodes joined by emulated links; seeded, so runs repeat.
    Must be used inside one running event loop."""

    def __init__(self, seed: int = 0, default: LinkModel | None = None) -> None:
        self._rng = random.Random(seed)
        self._default = default or LinkModel()
        self._links: dict[tuple[str, str], LinkModel] = {}
        self._nodes: dict[str, MemoryChannel] = {}
        self._busy_until: dict[tuple[str, str], float] = {}
        self._dead: set[str] = set()
        self._handles: dict[int, asyncio.TimerHandle] = {}
        self._next_handle = 0
        self.sent = 0
        self.dropped = 0
        self.bytes_sent: dict[tuple[str, str], int] = {}  # payload bytes per (src, dst)

    def node(self, name: str) -> MemoryChannel:
        if name not in self._nodes:
            self._nodes[name] = MemoryChannel(self, name)
        return self._nodes[name]

    def attach(self, channel: MemoryChannel) -> MemoryChannel:
        """Register a node object (a subclass that instruments its sends)."""
        self._nodes[channel.name] = channel
        return channel

    def set_link(self, src: str, dst: str, model: LinkModel, *, both: bool = False) -> None:
        self._links[(src, dst)] = model
        if both:
            self._links[(dst, src)] = model

    def kill(self, name: str) -> None:
        """The node dies: nothing more reaches it or leaves it."""
        self._dead.add(name)

    def is_dead(self, name: str) -> bool:
        return name in self._dead

    def close(self) -> None:
        """Drop everything still in flight."""
        for h in self._handles.values():
            h.cancel()
        self._handles.clear()

    def transit_time(
        self, model: LinkModel, nbytes: int, key: tuple[str, str], now: float
    ) -> float:
        """Arrival time of a message sent at ``now`` (and book the link)."""
        start = max(now, self._busy_until.get(key, now))
        done = start + (nbytes * 8 / model.rate_bps if model.rate_bps else 0.0)
        self._busy_until[key] = done
        t = (
            done + model.delay + abs(self._rng.gauss(0.0, model.jitter))
            if model.jitter
            else done + model.delay
        )
        if model.segment_loss:
            segs = max(1, math.ceil(nbytes / model.segment_bytes))
            t += model.rto * sum(self._rng.random() < model.segment_loss for _ in range(segs))
        if model.reorder and self._rng.random() < model.reorder:
            t += model.reorder_delay
        return t

    def _send(self, src: str, dst: str, frame_type: int, payload: bytes) -> None:
        if src in self._dead:
            raise PeerGone(f"node {src} is dead")
        if dst not in self._nodes:
            raise PeerGone(f"no node named {dst}")
        self.sent += 1
        self.bytes_sent[(src, dst)] = self.bytes_sent.get((src, dst), 0) + len(payload)
        model = self._links.get((src, dst), self._default)
        if dst in self._dead or self._rng.random() < model.loss:
            self.dropped += 1
            return
        copies = 2 if self._rng.random() < model.duplicate else 1
        loop = asyncio.get_running_loop()
        for _ in range(copies):
            at = self.transit_time(model, len(payload), (src, dst), loop.time())
            gram = Datagram(src, frame_type, payload)
            self._next_handle += 1
            key = self._next_handle
            self._handles[key] = loop.call_at(at, self._deliver, key, dst, gram)

    def _deliver(self, key: int, dst: str, gram: Datagram) -> None:
        self._handles.pop(key, None)
        if dst in self._dead:
            self.dropped += 1
            return
        self._nodes[dst].queue.put_nowait(gram)


class MemoryChannel:
    """A node of a :class:`MemoryNetwork` (implements :class:`MessageChannel`)."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.network = network
        self.name = name
        self.queue: asyncio.Queue[Datagram] = asyncio.Queue()

    async def send(self, dst: str, frame_type: int, payload: bytes) -> None:
        self.network._send(self.name, dst, frame_type, payload)

    async def recv(self, timeout: float) -> Datagram | None:
        if self.network.is_dead(self.name):
            raise PeerGone(f"node {self.name} is dead")
        try:
            return await asyncio.wait_for(self.queue.get(), max(timeout, 0.0))
        except TimeoutError:
            return None


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
