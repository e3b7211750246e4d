"""The deadlines of many transfers on one event-loop timer.

Every transfer handle has a deadline, but a loop timer per handle costs a
small transfer more than its own bookkeeping: on uvloop, ``call_later`` and
its ``cancel`` take 1.4 us together (a loop of each in one process on a
2-core x86 VM), against a 4 KiB put over shared memory of about 6 us.  A
:class:`Deadlines` keeps ``(deadline, handle)`` entries instead and arms one
timer, for the earliest entry whose handle is still pending:

- adding is an append when deadlines come in order (one timeout for all,
  the usual case) and a heap push otherwise;
- a handle that resolves does nothing here: its entry is dropped when the
  timer reaches it, or when the entries outgrow twice the ones still
  pending (so memory stays bounded by the transfers in flight, amortised
  O(1) per entry);
- when the timer fires, every pending handle whose deadline passed is
  expired (``handle._expire()``), in deadline order.

A handle counts as pending while its ``settled`` is False."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from typing import Any, Protocol

__all__ = ["Deadlines"]

_MIN_COMPACT = 1024  # entries kept before the first compaction


class _Expiring(Protocol):
    @property
    def settled(self) -> bool: ...

    def _expire(self) -> None: ...


class Deadlines:
    """Deadlines (on the ``time.monotonic()`` clock) of handles on one loop."""

    __slots__ = ("_at", "_fifo", "_heap", "_limit", "_loop", "_seq", "_timer")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fifo: deque[tuple[float, Any]] = deque()  # in deadline order
        self._heap: list[tuple[float, int, Any]] = []  # the ones that came out of order
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0  # the armed timer's deadline
        self._limit = _MIN_COMPACT

    def __len__(self) -> int:
        """Entries held (pending or not yet dropped)."""
        return len(self._fifo) + len(self._heap)

    def add(self, handle: _Expiring, deadline: float, loop: asyncio.AbstractEventLoop) -> None:
        """Expire ``handle`` at ``deadline`` unless it settled by then."""
        fifo = self._fifo
        if not fifo or deadline >= fifo[-1][0]:
            fifo.append((deadline, handle))
        else:
            heapq.heappush(self._heap, (deadline, next(self._seq), handle))
        if self._timer is None:
            self._loop = loop
            self._arm(deadline)
        elif deadline < self._at:
            self._timer.cancel()
            self._arm(deadline)
        if len(fifo) + len(self._heap) > self._limit:
            self._compact()

    def close(self) -> None:
        """Stop the timer and drop every entry (their handles were failed)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._fifo.clear()
        self._heap.clear()

    # -- internals ----------------------------------------------------------------
    def _arm(self, deadline: float) -> None:
        loop = self._loop
        assert loop is not None
        self._at = deadline
        # 1 ms late rather than early: a loop's timers round to milliseconds
        delay = max(0.0, deadline - time.monotonic()) + 0.001
        self._timer = loop.call_at(loop.time() + delay, self._fire)

    def _compact(self) -> None:
        self._fifo = deque(e for e in self._fifo if not e[1].settled)
        self._heap = [e for e in self._heap if not e[2].settled]
        heapq.heapify(self._heap)
        self._limit = max(_MIN_COMPACT, 2 * len(self))

    def _front(self) -> tuple[float, Any, bool] | None:
        """The earliest entry of the two containers (deadline, handle, from
        the fifo), or None when both are empty."""
        fifo, heap = self._fifo, self._heap
        if fifo and (not heap or fifo[0][0] <= heap[0][0]):
            return fifo[0][0], fifo[0][1], True
        if heap:
            return heap[0][0], heap[0][2], False
        return None

    def _fire(self) -> None:
        self._timer = None
        now = time.monotonic()
        # an _expire may add entries or compact: the front is read afresh each
        # time; a settled entry is dropped whatever its deadline
        while (front := self._front()) is not None:
            deadline, handle, in_fifo = front
            if not handle.settled and deadline > now:
                break
            if in_fifo:
                self._fifo.popleft()
            else:
                heapq.heappop(self._heap)
            if not handle.settled:
                handle._expire()
        else:
            return
        if self._timer is not None:  # an _expire added a handle, which armed it
            if deadline >= self._at:
                return
            self._timer.cancel()
        self._arm(deadline)
