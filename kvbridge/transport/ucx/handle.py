"""A transfer in flight over UCX: awaitable, cancellable, with statistics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from ..._waits import wait_within
from ...errors import Cancelled, KVBridgeError, TransferTimeout

__all__ = ["TransferHandle", "TransferStats"]


@dataclass
class TransferStats:
    request_id: str
    direction: str  # "send" or "recv"
    path: str = ""  # "put" (zero-copy) or "staging" (pack, put, unpack)
    bytes: int = 0  # KV bytes moved (put payload, or wire bytes when staged)
    runs: int = 0  # one-sided puts posted (after coalescing)
    chunks: int = 0  # staging chunks
    retries: int = 0  # always 0: UCX retransmits below us
    layers_done: int = 0  # receiver: layers of the expected range that landed
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def gbps(self) -> float:
        s = self.seconds
        return self.bytes / s / 1e9 if s > 0 else 0.0


class TransferHandle:
    """One send or one expected receive.  ``await handle`` returns the
    :class:`TransferStats` or raises a :mod:`kvbridge.errors` error; a
    deadline (``timeout``) is armed at creation, whether awaited or not."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: str,
        direction: str,
        timeout: float,
        on_abort: Callable[[TransferHandle, KVBridgeError], None],
    ) -> None:
        self.request_id = request_id
        self.stats = TransferStats(request_id, direction)
        self._future: asyncio.Future[TransferStats] = loop.create_future()
        self._on_abort = on_abort
        self._timer = loop.call_later(timeout, self._expire, timeout)
        # set by the agent: the peer, the staging task, the receiver's state
        self._peer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._expect: Any = None

    # -- state --------------------------------------------------------------
    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def __await__(self) -> Generator[Any, None, TransferStats]:
        return asyncio.shield(self._future).__await__()

    async def wait(self, timeout: float | None = None) -> TransferStats:
        """Wait at most ``timeout`` seconds more (the handle's own deadline
        still applies); raises TransferTimeout without cancelling the transfer."""
        return await wait_within(
            asyncio.shield(self._future),
            timeout,
            lambda: TransferTimeout(f"{self.request_id}: not done within {timeout} s"),
        )

    # -- completion (used by the agent) ---------------------------------------
    def _finish(self) -> None:
        if not self._future.done():
            self.stats.finished = time.monotonic()
            self._timer.cancel()
            self._future.set_result(self.stats)

    def _fail(self, exc: KVBridgeError) -> bool:
        if self._future.done():
            return False
        self.stats.finished = time.monotonic()
        self._timer.cancel()
        self._future.set_exception(exc)
        # Nobody may await a failed handle; do not warn about it.
        self._future.exception()
        return True

    def _expire(self, timeout: float) -> None:
        exc = TransferTimeout(
            f"{self.stats.direction} {self.request_id!r}: deadline of {timeout} s passed"
        )
        if self._fail(exc):
            self._on_abort(self, exc)

    def cancel(self, reason: str = "cancelled") -> bool:
        """Cancel locally (raises Cancelled in waiters) and tell the peer."""
        exc = Cancelled(f"{self.stats.direction} {self.request_id!r}: {reason}")
        if self._fail(exc):
            self._on_abort(self, exc)
            return True
        return False
