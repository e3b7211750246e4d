"""Which chunk goes out next, across every transfer on one link.

``srpt`` (the default) picks the transfer with the highest priority, then the
fewest bytes left to send, then the oldest; so a 1 MiB transfer that arrives
while a 2 GiB one streams goes out within two chunks per stream (the one being
written, the one being prepared).  ``fifo`` sends transfers in arrival order
(the baseline the benchmark compares with).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from ...errors import InvalidArgument

__all__ = ["ChunkScheduler", "Schedulable"]


class Schedulable(Protocol):
    priority: int
    arrival: int

    @property
    def unsent_bytes(self) -> int: ...

    def has_pending(self) -> bool: ...

    def pop_pending(self) -> int: ...


class ChunkScheduler:
    POLICIES = ("srpt", "fifo")

    def __init__(self, policy: str = "srpt") -> None:
        if policy not in self.POLICIES:
            raise InvalidArgument(
                f"scheduler policy must be one of {self.POLICIES}, not {policy!r}"
            )
        self.policy = policy
        self._items: list[Schedulable] = []
        self._wake = asyncio.Event()

    def add(self, item: Schedulable) -> None:
        self._items.append(item)
        if item.has_pending():
            self.wake()

    def remove(self, item: Schedulable) -> None:
        if item in self._items:
            self._items.remove(item)

    def wake(self) -> None:
        """Something became sendable (a new transfer, a chunk to resend)."""
        self._wake.set()

    def __len__(self) -> int:
        return len(self._items)

    def idle(self) -> bool:
        """No chunk of any transfer waits to be sent: a new transfer's chunk
        would be picked first, whatever the policy."""
        return not any(t.has_pending() for t in self._items)

    def pick(self) -> tuple[Schedulable, int] | None:
        ready = [t for t in self._items if t.has_pending()]
        if not ready:
            return None
        if self.policy == "srpt":
            best = min(ready, key=lambda t: (-t.priority, t.unsent_bytes, t.arrival))
        else:
            best = min(ready, key=lambda t: t.arrival)
        return best, best.pop_pending()

    async def next(self) -> tuple[Schedulable, int]:
        """Wait for the next chunk to send."""
        while True:
            got = self.pick()
            if got is not None:
                return got
            self._wake.clear()
            await self._wake.wait()
