"""Per-destination delivery handles and their statistics.

A :class:`Delivery` wraps one transport's handle (TCP or UCX) behind one
shape: awaitable, ``progress``, ``cancel``, ``stats``.  A :class:`SendGroup`
is what one send to several destinations returns: :class:`MultiSend` (the
whole range at once) or :class:`~kvbridge.bridge.prefill.LayerwiseSend`.
Each destination completes on its own; the group ends when every one has,
and then the send's lease on the pages is released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from .._waits import wait_within
from ..errors import KVBridgeError, TransferTimeout

__all__ = ["Delivery", "DeliveryStats", "MultiSend", "Outcome", "SendGroup", "count_outcome"]


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


Outcome = DeliveryStats | KVBridgeError


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
        self._fail_as: KVBridgeError | None = None
        self._task: asyncio.Task[DeliveryStats] = asyncio.ensure_future(self._run(inner, finish))
        # a failed delivery nobody awaits must not be reported as "never retrieved"
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _run(
        self, inner: Awaitable[Any], finish: Callable[[Any, DeliveryStats], None] | None
    ) -> DeliveryStats:
        try:
            result = await inner
        except KVBridgeError as e:
            if self._fail_as is not None:
                raise self._fail_as from e
            raise
        self.stats.seconds = time.perf_counter() - self._t0
        if finish is not None:
            finish(result, self.stats)
        return self.stats

    @property
    def progress(self) -> float:
        return 1.0 if self._task.done() and self._task.exception() is None else self._progress()

    def done(self) -> bool:
        return self._task.done()

    def outcome(self) -> Outcome | None:
        """The stats or the typed error of a finished delivery; None while it runs."""
        if not self._task.done():
            return None
        exc = self._task.exception()
        if exc is None:
            return self._task.result()
        if isinstance(exc, KVBridgeError):
            return exc
        raise exc

    def cancel(self, reason: str = "cancelled") -> None:
        if not self._task.done():
            self._cancel(reason)

    def fail(self, exc: KVBridgeError) -> None:
        """End an unfinished delivery at both ends; it fails with ``exc``."""
        if not self._task.done():
            self._fail_as = exc
            self._cancel(str(exc))

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


class SendGroup:
    """The deliveries of one send, by destination name.  Each destination
    completes (or fails) on its own: :meth:`outcome` awaits one, and
    callbacks registered with :meth:`on_outcome` run as each finishes.
    :meth:`on_done` callbacks run once every destination has finished (the
    lease on the pages is released then)."""

    def __init__(self, request_id: str, destinations: list[str]) -> None:
        self.request_id = request_id
        self.destinations = list(destinations)
        self.outcomes: dict[str, Outcome] = {}
        self._outcome_cbs: list[Callable[[str, Outcome], None]] = []
        self._done_cbs: list[Callable[[SendGroup], None]] = []

    # subclasses: the outcome of one destination, and ending the rest
    async def outcome(self, name: str) -> DeliveryStats:
        raise NotImplementedError

    def cancel(self, reason: str = "cancelled by the sender") -> None:
        raise NotImplementedError

    def fail(self, exc: KVBridgeError) -> None:
        """End every unfinished destination at both ends with ``exc`` (an
        expired lease, a closing bridge)."""
        raise NotImplementedError

    # ---- completion ------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return len(self.outcomes) == len(self.destinations)

    def on_outcome(self, fn: Callable[[str, Outcome], None]) -> None:
        """``fn(name, stats_or_error)`` as each destination finishes (at once
        for those that already have)."""
        self._outcome_cbs.append(fn)
        for name, out in list(self.outcomes.items()):
            fn(name, out)

    def on_done(self, fn: Callable[[SendGroup], None]) -> None:
        """``fn(group)`` once every destination has finished."""
        if self.finished:
            fn(self)
        else:
            self._done_cbs.append(fn)

    def _record(self, name: str, out: Outcome) -> None:
        if name in self.outcomes:
            return
        self.outcomes[name] = out
        for fn in list(self._outcome_cbs):
            fn(name, out)
        if self.finished:
            cbs, self._done_cbs = self._done_cbs, []
            for done in cbs:
                done(self)

    async def _watch(self, name: str) -> None:
        try:
            out: Outcome = await self.outcome(name)
        except KVBridgeError as e:
            out = e
        self._record(name, out)

    def _start_watching(self) -> list[asyncio.Task[None]]:
        return [asyncio.ensure_future(self._watch(n)) for n in self.destinations]

    # ---- waiting ---------------------------------------------------------------------
    async def wait_all(self, timeout: float | None = None) -> dict[str, Outcome]:
        """Wait for every destination; a failed one maps to its exception."""
        names = list(self.destinations)
        results = await asyncio.gather(
            *(wait_within(self.outcome(n), timeout, self._late(n, timeout)) for n in names),
            return_exceptions=True,
        )
        out: dict[str, Outcome] = {}
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

    def _late(self, name: str, timeout: float | None) -> Callable[[], KVBridgeError]:
        return lambda: TransferTimeout(
            f"{name}: {self.request_id!r} not delivered after {timeout} s"
        )


class MultiSend(SendGroup):
    """A send of the whole range to every destination at once."""

    def __init__(self, request_id: str, deliveries: Mapping[str, Delivery]) -> None:
        super().__init__(request_id, list(deliveries))
        self.deliveries = dict(deliveries)
        self._tasks = self._start_watching()

    def __getitem__(self, name: str) -> Delivery:
        return self.deliveries[name]

    async def outcome(self, name: str) -> DeliveryStats:
        return await self.deliveries[name]

    def cancel(self, reason: str = "cancelled by the sender") -> None:
        for d in self.deliveries.values():
            d.cancel(reason)

    def fail(self, exc: KVBridgeError) -> None:
        for d in self.deliveries.values():
            d.fail(exc)


def count_outcome(d: Delivery, stats: Any) -> None:
    """When ``d`` ends, add its bytes to ``stats.bytes``, or one to
    ``stats.failed`` (a typed failure, a cancel, anything else)."""

    def done(dd: Delivery) -> None:
        try:
            out = dd.outcome()
        except BaseException:  # cancelled, or not a kvbridge error
            out = None
        if isinstance(out, DeliveryStats):
            stats.bytes += out.bytes
        else:
            stats.failed += 1

    d.add_done_callback(done)
