"""Request leases on the sender: how long the engine keeps a request's pages
pinned for kvbridge.

A send takes a lease on its request's pages (default 30 s).  The lease ends
when the send does (every destination delivered, failed or was cancelled):
the pages are the engine's again.  If it runs out first, the bridge aborts
the send at both ends and reports :class:`~kvbridge.errors.LeaseExpired`, so
no side holds pages for ever.  The engine may renew a lease while the send
runs (a slow WAN, a long layer-wise prefill).

:class:`LeaseTable` is the bookkeeping alone: no event loop, no thread, a
clock passed in (``time.monotonic`` by default), so tests drive it with a fake
clock.  The bridges arm one timer at :attr:`LeaseTable.next_deadline` and
call :meth:`LeaseTable.pop_expired` when it fires.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InvalidArgument

__all__ = ["DEFAULT_LEASE", "Lease", "LeaseTable"]

DEFAULT_LEASE = 30.0


@dataclass
class Lease:
    request_id: str
    seconds: float  # the length it was granted (or last renewed) with
    granted: float  # clock time of the grant
    deadline: float  # clock time it runs out
    renewals: int = 0


def check_lease_seconds(seconds: float, what: str = "lease") -> float:
    """A lease length: a finite number of seconds > 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {seconds!r}")
    s = float(seconds)
    if not math.isfinite(s) or s <= 0:
        raise InvalidArgument(f"{what} must be finite and > 0 seconds, got {seconds!r}")
    return s


class LeaseTable:
    """The live leases of one sender, by request id."""

    def __init__(
        self, default: float = DEFAULT_LEASE, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.default = check_lease_seconds(default, "lease_timeout")
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._heap: list[tuple[float, str]] = []  # (deadline, rid); stale entries skipped

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def grant(
        self, request_id: str, seconds: float | None = None, *, now: float | None = None
    ) -> Lease:
        """A new lease for a request that holds none, from ``now`` (clock
        time; None: the clock's now)."""
        if request_id in self._leases:
            raise InvalidArgument(f"request {request_id!r} already holds a lease (a send runs)")
        s = self.default if seconds is None else check_lease_seconds(seconds)
        if now is None:
            now = self.clock()
        lease = Lease(request_id, s, now, now + s)
        self._leases[request_id] = lease
        heapq.heappush(self._heap, (lease.deadline, request_id))
        return lease

    def renew(
        self, request_id: str, seconds: float | None = None, *, now: float | None = None
    ) -> Lease | None:
        """Extend a live lease to ``seconds`` from ``now`` (None: the clock's
        now; ``seconds`` None: the length it was granted with).  Returns None when the request holds no lease (its
        send ended, or it never had one): there is nothing left to renew."""
        lease = self._leases.get(request_id)
        s = None if seconds is None else check_lease_seconds(seconds)
        if lease is None:
            return None
        if s is not None:
            lease.seconds = s
        lease.deadline = (self.clock() if now is None else now) + lease.seconds
        lease.renewals += 1
        heapq.heappush(self._heap, (lease.deadline, request_id))
        return lease

    def release(self, request_id: str) -> Lease | None:
        """The send ended: the pages are the engine's again."""
        return self._leases.pop(request_id, None)

    def pop_expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return every lease whose deadline has passed."""
        t = self.clock() if now is None else now
        out: list[Lease] = []
        while self._heap and self._heap[0][0] <= t:
            deadline, rid = heapq.heappop(self._heap)
            lease = self._leases.get(rid)
            if lease is not None and lease.deadline == deadline and lease.deadline <= t:
                del self._leases[rid]
                out.append(lease)
        return out

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline of a live lease (clock time), if any."""
        while self._heap:
            deadline, rid = self._heap[0]
            lease = self._leases.get(rid)
            if lease is not None and lease.deadline == deadline:
                return deadline
            heapq.heappop(self._heap)
        return None
