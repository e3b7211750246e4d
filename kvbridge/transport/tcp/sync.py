"""Blocking wrappers for engines without an event loop.

One background thread runs a uvloop event loop; :class:`SyncReceiver` and
:class:`SyncSender` forward every call to it.  Handles are thread-safe:
``wait(timeout)`` blocks the caller, ``cancel()`` and ``progress`` work from
any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from ...errors import TransferTimeout
from . import new_event_loop
from .kvio import Sink, Source
from .receiver import ExpectHandle, TcpReceiver
from .sender import SendHandle, TcpSender

__all__ = ["EventLoopThread", "SyncHandle", "SyncReceiver", "SyncSender"]

T = TypeVar("T")
H = TypeVar("H", ExpectHandle, SendHandle)


class EventLoopThread:
    """An event loop in a daemon thread; :meth:`call` runs a coroutine on it."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvbridge-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransferTimeout(f"call did not finish within {timeout} s") from None

    def call_soon(self, fn: Callable[[], T]) -> T:
        async def wrap() -> T:
            return fn()

        return self.call(wrap())

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class SyncHandle(Generic[H]):
    """A blocking view of an :class:`ExpectHandle` or :class:`SendHandle`."""

    def __init__(self, loop: EventLoopThread, handle: H) -> None:
        self._loop = loop
        self.handle: H = handle

    @property
    def progress(self) -> float:
        return float(self.handle.progress)

    @property
    def token(self) -> bytes:
        assert isinstance(self.handle, ExpectHandle)
        return self.handle.token

    def done(self) -> bool:
        return bool(self.handle.done())

    def cancel(self) -> None:
        self._loop.loop.call_soon_threadsafe(self.handle.cancel)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the transfer completes; raises its typed error."""
        return self._loop.call(self.handle.wait(timeout))


class SyncReceiver:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lt = EventLoopThread()

        async def make() -> TcpReceiver:
            return await TcpReceiver(*args, **kwargs).start()

        try:
            self.receiver = self._lt.call(make(), 30)
        except BaseException:
            self._lt.stop()
            raise

    @property
    def port(self) -> int:
        return self.receiver.port

    def expect(
        self, request_id: str, sink: Sink, *, timeout: float | None = None
    ) -> SyncHandle[ExpectHandle]:
        h = self._lt.call_soon(lambda: self.receiver.expect(request_id, sink, timeout=timeout))
        return SyncHandle(self._lt, h)

    def close(self) -> None:
        try:
            self._lt.call(self.receiver.close(), 30)
        finally:
            self._lt.stop()

    def __enter__(self) -> SyncReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncSender:
    def __init__(self, host: str, port: int, **kwargs: Any) -> None:
        self._lt = EventLoopThread()
        self.sender = self._lt.call_soon(lambda: TcpSender(host, port, **kwargs))

    def connect(self, timeout: float | None = None) -> None:
        self._lt.call(self.sender.connect(), timeout)

    def send(
        self,
        request_id: str,
        source: Source,
        *,
        token: bytes,
        priority: int = 0,
        timeout: float | None = None,
        compression: str | None = None,
    ) -> SyncHandle[SendHandle]:
        h = self._lt.call_soon(
            lambda: self.sender.send(
                request_id,
                source,
                token=token,
                priority=priority,
                timeout=timeout,
                compression=compression,
            )
        )
        return SyncHandle(self._lt, h)

    def close(self) -> None:
        try:
            self._lt.call(self.sender.close(), 30)
        finally:
            self._lt.stop()

    def __enter__(self) -> SyncSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
