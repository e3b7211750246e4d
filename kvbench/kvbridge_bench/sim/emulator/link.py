"""One direction of the emulated line, without IO.

A packet offered at time ``now`` may be lost (random loss), dropped at the
tail of the serializer's queue, or scheduled: it leaves the serializer when
all bytes queued before it and its own bytes have gone out at the line rate,
and is delivered one-way delay (plus jitter) later.  Times are seconds of a
monotonic clock that the caller passes in, so the model is deterministic for
a given seed and testable without a network.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from .params import LinkParams


@dataclass
class LinkStats:
    packets_in: int = 0
    bytes_in: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0
    packets_out: int = 0
    bytes_out: int = 0
    write_errors: int = 0
    max_queue_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Link:
    """Serializer + delay line for one direction."""

    params: LinkParams
    mtu: int
    rtt_s: float
    rng: random.Random = field(default_factory=random.Random)
    stats: LinkStats = field(default_factory=LinkStats)

    def __post_init__(self) -> None:
        self._busy_until = 0.0  # when the serializer finishes its last queued byte
        self._last_due = 0.0
        self._seq = 0
        self._fifo: deque[tuple[float, bytes]] = deque()
        self._heap: list[tuple[float, int, bytes]] = []
        self._apply(self.params)

    def _apply(self, params: LinkParams) -> None:
        self.params = params
        self._queue_limit = params.resolved_queue(self.mtu, self.rtt_s)
        self._byte_time = 8.0 / params.rate_bps if params.rate_bps > 0 else 0.0

    def update(self, params: LinkParams) -> None:
        """Change the parameters; packets already scheduled keep their times."""
        if params.reorder != self.params.reorder:
            for due, pkt in sorted(self._drain_all(), key=lambda item: item[0]):
                self._store(due, pkt, params.reorder)
        self._apply(params)

    @property
    def queue_limit(self) -> int:
        return self._queue_limit

    def queued_bytes(self, now: float) -> int:
        """Bytes waiting in (or being sent by) the serializer at ``now``."""
        if self._byte_time == 0.0:
            return 0
        return max(0, int((self._busy_until - now) / self._byte_time))

    def offer(self, now: float, size: int) -> float | None:
        """Account a packet of ``size`` bytes arriving at ``now``; return its
        delivery time, or ``None`` when it is dropped."""
        st = self.stats
        st.packets_in += 1
        st.bytes_in += size
        p = self.params
        if p.loss > 0.0 and self.rng.random() < p.loss:
            st.dropped_loss += 1
            return None
        queued = self.queued_bytes(now)
        if queued + size > self._queue_limit:
            st.dropped_queue += 1
            return None
        st.max_queue_bytes = max(st.max_queue_bytes, queued + size)
        start = self._busy_until if self._busy_until > now else now
        self._busy_until = start + size * self._byte_time
        due = self._busy_until + p.delay_s
        if p.jitter_s > 0.0:
            due += self.rng.random() * p.jitter_s
        if not p.reorder and due < self._last_due:
            due = self._last_due
        self._last_due = max(self._last_due, due)
        return due

    def push(self, now: float, packet: bytes) -> bool:
        """Offer a packet and keep it until it is due; False if dropped."""
        due = self.offer(now, len(packet))
        if due is None:
            return False
        self._store(due, packet, self.params.reorder)
        return True

    def _store(self, due: float, packet: bytes, reorder: bool) -> None:
        if reorder:
            self._seq += 1
            heapq.heappush(self._heap, (due, self._seq, packet))
        else:
            self._fifo.append((due, packet))

    def _drain_all(self) -> list[tuple[float, bytes]]:
        out = list(self._fifo)
        self._fifo.clear()
        out.extend((d, p) for d, _, p in self._heap)
        self._heap.clear()
        return out

    def next_due(self) -> float | None:
        """Delivery time of the earliest held packet, or None when empty."""
        best: float | None = self._fifo[0][0] if self._fifo else None
        if self._heap and (best is None or self._heap[0][0] < best):
            best = self._heap[0][0]
        return best

    def pop_due(self, now: float) -> list[bytes]:
        """Remove and return the packets due at or before ``now``, in order."""
        out: list[bytes] = []
        fifo = self._fifo
        while fifo and fifo[0][0] <= now:
            out.append(fifo.popleft()[1])
        heap = self._heap
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[2])
        return out

    def held(self) -> int:
        """Packets scheduled but not yet delivered."""
        return len(self._fifo) + len(self._heap)
