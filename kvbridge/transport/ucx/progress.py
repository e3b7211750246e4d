"""UCX worker progress, in one of two modes (``UcxAgent(progress=...)``).

``"thread"`` (default): the engine's own C++ thread progresses the worker.
It busy-polls for ``busy_poll_us`` after each event (the next packet of a
small exchange is close: a put's flush answer, the notification after it),
then arms the worker and sleeps in epoll on the worker's event fd.  UCX
progress never waits on the asyncio loop (a pack, a slow callback); the
thread answers the peer's puts and flushes by itself and writes the engine's
notify fd when results, failures or messages are queued, which the loop
watches with ``add_reader``.  While the loop waits for a small operation
(a put in flight, an expected request) it polls the worker itself for
``busy_poll_us`` after the last event, and the thread sleeps: one poller per
process, never two spinning on a 2-core machine.

``"loop"``: the asyncio loop progresses the worker.  While work is
outstanding, and for a short ``hot_window`` (2 ms) after any progress call
that found work, the worker is progressed on every loop iteration
(``call_soon``); otherwise its event fd is armed and watched with
``loop.add_reader``.  A periodic safety progress (0.1 s) covers events that
arrive between a progress and the arm.

In both modes a small put also progresses inline, in C++, for up to
``busy_poll_us`` right after it is posted (``Engine.put``), so that it usually
completes before the call returns.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["POLL_SLICE_US", "LoopProgress", "Progress", "ThreadProgress"]

# The longest the loop's busy-poll holds the loop in one C++ call.
POLL_SLICE_US = 50


class Progress(Protocol):
    def kick(self) -> None:
        """Progress soon (after posting work that did not complete inline)."""

    def close(self) -> None: ...


class ThreadProgress:
    """The engine's thread progresses; after ``kick()`` (a post still in
    flight, an expect registered) the loop itself busy-polls the worker for
    ``busy_poll_us`` (extended by every event found), so that the answer of
    a small exchange is seen without an epoll wake-up of the loop; meanwhile
    the thread sleeps (one poller per process)."""

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        on_events: Callable[[], None],
        busy_poll_us: int,
        yield_us: int = 0,
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._on_events = on_events
        self._yield_us = int(yield_us)
        self._window = busy_poll_us / 1e6
        self._until = 0.0
        self._polling = False
        self._fd = int(engine.notify_fd())
        self._closed = False
        engine.start_thread(int(busy_poll_us))
        loop.add_reader(self._fd, on_events)

    def kick(self) -> None:
        if self._closed or self._window <= 0:
            return
        self._until = time.monotonic() + self._window
        if not self._polling:
            self._polling = True
            self._engine.set_polling(True)
            self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        if self._closed:
            return
        # Poll in C++ for a slice (without the GIL), back as soon as there
        # is something to account: the loop's other work waits at most one
        # slice, and an answer is seen within microseconds of its arrival.
        # The C++ poll gives the core away after `yield_us` without an event.
        left = self._until - time.monotonic()
        slice_us = max(1, min(POLL_SLICE_US, int(left * 1e6)))
        if self._engine.poll(slice_us, 0, self._yield_us):
            self._until = time.monotonic() + self._window
            self._on_events()
        if not self._closed and time.monotonic() < self._until:
            self._loop.call_soon(self._poll)
            return
        self._polling = False
        if not self._closed:
            self._engine.set_polling(False)  # the thread takes over (and signals)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._polling:
            self._engine.set_polling(False)
            self._polling = False
        self._engine.stop_thread()


class LoopProgress:
    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        on_events: Callable[[], None],
        busy: Callable[[], bool],
        safety_interval: float = 0.1,
        hot_window: float = 0.002,
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._on_events = on_events
        self._busy = busy
        self._interval = safety_interval
        self._hot_window = hot_window
        self._hot_until = 0.0
        self._fd = int(engine.event_fd())
        self._scheduled = False
        self._closed = False
        loop.add_reader(self._fd, self._pump)
        self._timer: asyncio.TimerHandle | None = loop.call_later(self._interval, self._safety)
        self.kick()

    def kick(self) -> None:
        """Progress on the next loop iteration (after posting work)."""
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._pump)

    def _safety(self) -> None:
        if self._closed:
            return
        self._pump()
        self._timer = self._loop.call_later(self._interval, self._safety)

    def _pump(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        while True:
            if self._engine.progress():
                self._hot_until = time.monotonic() + self._hot_window
            else:
                os.sched_yield()  # as ThreadProgress._poll
            self._on_events()
            if self._closed:
                return
            if self._busy() or time.monotonic() < self._hot_until:
                self.kick()
                return
            if self._engine.arm():
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
