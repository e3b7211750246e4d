"""The shape every transfer handle shares: awaitable, ``progress``, ``done``,
``cancel``, ``wait(timeout)``; resolved once by its transport."""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from .._waits import wait_within
from ..errors import TransferTimeout

__all__ = ["TransferHandleBase"]

R = TypeVar("R")


class TransferHandleBase(abc.ABC, Generic[R]):
    """Subclasses set ``_what`` (for the timeout message), ``_cancel_reason``,
    and implement ``_moved_bytes`` and ``_result``."""

    _what = "complete"
    _cancel_reason = "cancelled"

    def __init__(self, request_id: str, total: int, on_cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.total_bytes = total
        self._fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._on_cancel = on_cancel
        self._t0 = time.perf_counter()

    @abc.abstractmethod
    def _moved_bytes(self) -> int:
        """Bytes moved so far (received, or acknowledged)."""

    @abc.abstractmethod
    def _result(self, seconds: float) -> R:
        """What awaiting the handle returns once the transfer succeeded."""

    @property
    def progress(self) -> float:
        return 1.0 if self.total_bytes == 0 else self._moved_bytes() / self.total_bytes

    def done(self) -> bool:
        return self._fut.done()

    def cancel(self, reason: str | None = None) -> None:
        """Stop the transfer at both ends (ABORT) and release its buffers."""
        if not self._fut.done():
            self._on_cancel(reason or self._cancel_reason)

    async def wait(self, timeout: float | None = None) -> R:
        return await wait_within(
            asyncio.shield(self._fut),
            timeout,
            lambda: TransferTimeout(
                f"transfer {self.request_id!r} not {self._what} after {timeout} s"
            ),
        )

    def __await__(self) -> Generator[Any, None, R]:
        return asyncio.shield(self._fut).__await__()

    def _resolve(self, exc: BaseException | None) -> None:
        if self._fut.done():
            return
        seconds = time.perf_counter() - self._t0
        if exc is None:
            self._fut.set_result(self._result(seconds))
        else:
            self._fut.set_exception(exc)
            self._fut.exception()  # mark retrieved: the owner may never await a failed handle
