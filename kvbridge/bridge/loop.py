"""kvbridge's own event loop in a thread of its own, for callers that have
no event loop (the synchronous bridge)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..errors import BridgeClosed, CallTimeout, InvalidArgument, KVBridgeError, Unavailable
from ..transport.tcp import new_event_loop

__all__ = ["LoopThread"]

T = TypeVar("T")
_POLL_SLICE = 0.05  # how often a blocked caller checks that the loop thread still runs


class LoopThread:
    """kvbridge's event loop in a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self.stopped = threading.Event()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self.thread.start()
        if not started.wait(10):
            raise Unavailable("kvbridge's event-loop thread did not start within 10 s")

    def _run(self, started: threading.Event) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        loop.call_soon(started.set)
        try:
            loop.run_forever()
        finally:
            self.stopped.set()
            try:
                tasks = asyncio.all_tasks(loop)
                for t in tasks:
                    t.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.wait(tasks, timeout=2.0))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    def on_loop(self) -> bool:
        return threading.get_ident() == self.thread.ident

    def call(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float, what: str) -> T:
        """Run ``make()`` on the loop and wait at most ``timeout`` seconds."""
        if self.on_loop():
            raise InvalidArgument(
                f"{what} waits for kvbridge's loop thread, so it cannot be called from "
                "that thread (a control handler)"
            )
        if self.stopped.is_set():
            raise BridgeClosed(f"{what}: the bridge is closed")
        try:
            fut = asyncio.run_coroutine_threadsafe(make(), self.loop)
        except RuntimeError:  # the loop closed in between
            raise BridgeClosed(f"{what}: the bridge is closed") from None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return fut.result(max(0.0, min(left, _POLL_SLICE)))
            except concurrent.futures.CancelledError:
                raise BridgeClosed(f"{what}: the bridge closed while the call ran") from None
            except TimeoutError as e:
                if isinstance(e, KVBridgeError):
                    raise  # the call's own deadline, with its own message
                if self.stopped.is_set() and not fut.done():
                    fut.cancel()
                    raise BridgeClosed(f"{what}: the bridge is closed") from None
                if left <= 0:
                    fut.cancel()
                    raise CallTimeout(
                        f"{what}: no answer from kvbridge's loop thread within {timeout:g} s"
                    ) from None

    def call_fn(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        """Run ``fn()`` on the loop (at once when already there)."""
        if self.on_loop():
            return fn()

        async def run() -> T:
            return fn()

        return self.call(run, timeout, what)

    def stop(self, timeout: float) -> None:
        if not self.stopped.is_set():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:
                pass  # already closed
        if not self.on_loop():
            self.thread.join(max(0.0, timeout))
