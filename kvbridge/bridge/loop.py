"""kvbridge's own event loop in a thread of its own, for callers that have
no event loop (the synchronous bridge).

Callers hand work to the loop in two ways: :meth:`LoopThread.call` runs a
coroutine there and waits for its result (connect, start, close), and
:meth:`LoopThread.submit` queues a plain function and returns at once (the
engine-facing calls of :class:`~kvbridge.bridge.sync.SyncBridge`).  Submitted
functions run on the loop in the order they were submitted; the loop is woken
once per batch (one ``call_soon_threadsafe``, a write to its wakeup file
descriptor), not once per function."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..errors import BridgeClosed, CallTimeout, InvalidArgument, KVBridgeError, Unavailable
from ..transport.tcp import new_event_loop

__all__ = ["LoopThread"]

log = logging.getLogger("kvbridge.bridge")
T = TypeVar("T")
_POLL_SLICE = 0.05  # how often a blocked caller checks that the loop thread still runs


class LoopThread:
    """kvbridge's event loop in a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self.stopped = threading.Event()
        # submitted work: appended by any thread, drained on the loop (a deque's
        # append and popleft are atomic); _woken: a drain is scheduled
        self._ops: deque[Callable[[], None]] = deque()
        self._woken = False
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

    def submit(self, op: Callable[[], None]) -> None:
        """Queue ``op()`` to run on the loop after everything submitted
        before it, and return at once.  The first submit of a batch wakes the
        loop; the rest of the batch rides on that wakeup.  On the loop thread
        itself (a control handler) the queue is drained at once, ``op`` last.
        An ``op`` that raises is logged; it never stops the ones after it.
        Ops still queued when the loop stops do not run (the caller reports
        what they stood for)."""
        self._ops.append(op)
        if self.on_loop():
            self.drain()
            return
        if not self._woken:
            # set before the wakeup: drain() clears it before it pops, so an
            # op appended after that pop sees it clear and wakes the loop again
            self._woken = True
            try:
                self.loop.call_soon_threadsafe(self.drain)
            except RuntimeError:  # the loop closed: the op will not run
                pass

    def drain(self) -> None:
        """Run every submitted op, in order (on the loop thread only).  Also
        called by whatever must see the work submitted so far before it acts
        (a TCP OPEN naming a transfer token the loop does not know yet)."""
        self._woken = False
        ops = self._ops
        while ops:
            try:
                op = ops.popleft()
            except IndexError:  # a nested drain took it
                return
            try:
                op()
            except Exception:
                log.exception("a submitted call failed on kvbridge's loop thread")

    @property
    def queued(self) -> int:
        """Submitted ops not run yet."""
        return len(self._ops)

    def stop(self, timeout: float) -> None:
        if not self.stopped.is_set():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:
                pass  # already closed
        if not self.on_loop():
            self.thread.join(max(0.0, timeout))
