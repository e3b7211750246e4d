"""An in-memory message network with an emulated link (delay, jitter, rate,
loss, duplicates, reordering, segment loss with retransmission): a
:class:`~kvbridge.handoff.channel.MessageChannel` for handoff tests and
benchmarks on one machine."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

from kvbridge.errors import InvalidArgument, PeerGone
from kvbridge.handoff.channel import Datagram

__all__ = ["LinkModel", "MemoryChannel", "MemoryNetwork"]


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
