"""Per-destination delivery handles and their statistics.

A :class:`Delivery` wraps one transport's handle (TCP or UCX) behind one
shape: awaitable, ``progress``, ``cancel``, ``stats``.  A :class:`MultiSend`
groups the deliveries of one send to several destinations; each completes on
its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from .._waits import wait_within
from ..errors import KVBridgeError, TransferTimeout

__all__ = ["Delivery", "DeliveryStats", "MultiSend"]


@dataclass
class DeliveryStats:
    """What one delivery cost: ``path`` is "tcp", "ucx-put" or "ucx-staging"."""

    request_id: str
    destination: str
    path: str
    bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    streams: int = 0


class Delivery:
    """One destination's share of a send (or one expected transfer)."""

    def __init__(
        self,
        stats: DeliveryStats,
        inner: Awaitable[Any],
        progress: Callable[[], float],
        cancel: Callable[[str], Any],
        finish: Callable[[Any, DeliveryStats], None] | None = None,
    ) -> None:
        self.stats = stats
        self._progress = progress
        self._cancel = cancel
        self._t0 = time.perf_counter()
        self._task: asyncio.Task[DeliveryStats] = asyncio.ensure_future(self._run(inner, finish))
        # a failed delivery nobody awaits must not be reported as "never retrieved"
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _run(
        self, inner: Awaitable[Any], finish: Callable[[Any, DeliveryStats], None] | None
    ) -> DeliveryStats:
        result = await inner
        self.stats.seconds = time.perf_counter() - self._t0
        if finish is not None:
            finish(result, self.stats)
        return self.stats

    @property
    def progress(self) -> float:
        return 1.0 if self._task.done() and self._task.exception() is None else self._progress()

    def done(self) -> bool:
        return self._task.done()

    def cancel(self, reason: str = "cancelled") -> None:
        if not self._task.done():
            self._cancel(reason)

    async def wait(self, timeout: float | None = None) -> DeliveryStats:
        return await wait_within(
            asyncio.shield(self._task),
            timeout,
            lambda: TransferTimeout(
                f"{self.stats.destination}: {self.stats.request_id!r} not delivered "
                f"after {timeout} s"
            ),
        )

    def add_done_callback(self, fn: Callable[[Delivery], None]) -> None:
        self._task.add_done_callback(lambda _t: fn(self))

    def __await__(self) -> Generator[Any, None, DeliveryStats]:
        return asyncio.shield(self._task).__await__()


class MultiSend:
    """The deliveries of one send, by destination name.  Each destination
    completes (or fails) independently; ``wait_all`` reports each outcome."""

    def __init__(self, request_id: str, deliveries: Mapping[str, Delivery]) -> None:
        self.request_id = request_id
        self.deliveries = dict(deliveries)

    def __getitem__(self, name: str) -> Delivery:
        return self.deliveries[name]

    def cancel(self, reason: str = "cancelled by the sender") -> None:
        for d in self.deliveries.values():
            d.cancel(reason)

    async def wait_all(
        self, timeout: float | None = None
    ) -> dict[str, DeliveryStats | KVBridgeError]:
        """Wait for every destination; a failed one maps to its exception."""
        names = list(self.deliveries)
        results = await asyncio.gather(
            *(self.deliveries[n].wait(timeout) for n in names), return_exceptions=True
        )
        out: dict[str, DeliveryStats | KVBridgeError] = {}
        for n, r in zip(names, results, strict=True):
            if isinstance(r, KVBridgeError | DeliveryStats):
                out[n] = r
            elif isinstance(r, BaseException):
                raise r
        return out

    async def wait(self, timeout: float | None = None) -> dict[str, DeliveryStats]:
        """Wait for every destination; raise the first failure."""
        out = await self.wait_all(timeout)
        for r in out.values():
            if isinstance(r, KVBridgeError):
                raise r
        return {k: v for k, v in out.items() if isinstance(v, DeliveryStats)}
