"""UCX worker progress tied into asyncio without spinning when idle.

While work is outstanding (posted operations, staged transfers), and for a
short ``hot_window`` (2 ms) after any progress call that found work (bytes
streaming in for a receiver), the worker is progressed on every loop
iteration (``call_soon``).  Otherwise the worker's event fd is armed and
watched with ``loop.add_reader``: the process sleeps until the network has
something for it.  A periodic safety progress (``safety_interval``, 0.1 s) covers events that
arrive between a progress and the arm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class WorkerProgress:
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
