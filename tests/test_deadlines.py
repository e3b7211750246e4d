"""Deadlines: many handles' deadlines on one loop timer."""

from __future__ import annotations

import asyncio
import time

from kvbridge.transport.deadlines import Deadlines


class _H:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.settled = False

    def _expire(self) -> None:
        self.settled = True
        self.log.append(self.name)


def test_expires_pending_handles_in_deadline_order_whatever_order_they_came_in() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        d, log = Deadlines(), []
        now = time.monotonic()
        hs = {n: _H(n, log) for n in "abcde"}
        d.add(hs["a"], now + 0.3, loop)
        d.add(hs["b"], now + 0.05, loop)  # earlier than the armed timer: re-armed
        d.add(hs["c"], now + 0.35, loop)
        d.add(hs["d"], now + 0.2, loop)
        d.add(hs["e"], now + 0.25, loop)
        hs["d"].settled = True  # resolved before its deadline: not expired
        await asyncio.sleep(0.12)  # (a slow VM may wake up late: margins of 80 ms)
        assert log == ["b"]
        await asyncio.sleep(0.35)
        assert log == ["b", "e", "a", "c"]
        assert len(d) == 0 and d._timer is None

    asyncio.run(body())


def test_settled_entries_are_dropped_and_memory_stays_bounded() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        d, log = Deadlines(), []
        waiting = _H("waiting", log)  # one long wait at the front
        d.add(waiting, time.monotonic() + 60, loop)
        for i in range(20000):
            h = _H(str(i), log)
            d.add(h, time.monotonic() + 60, loop)
            h.settled = True  # each resolves at once, as small transfers do
        assert len(d) <= 2100  # compacted: not 20001 entries
        assert log == []
        d.close()
        assert len(d) == 0 and d._timer is None

    asyncio.run(body())


def test_an_expiry_that_adds_a_handle_keeps_the_earliest_deadline_armed() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        d, log = Deadlines(), []
        now = time.monotonic()
        later = _H("later", log)

        class Chain(_H):
            def _expire(self) -> None:
                super()._expire()
                d.add(later, time.monotonic() + 0.2, loop)  # armed from inside the fire

        d.add(Chain("first", log), now + 0.01, loop)
        d.add(_H("second", log), now + 0.05, loop)
        await asyncio.sleep(0.1)
        assert log == ["first", "second"]  # "second" did not wait for "later"'s timer
        await asyncio.sleep(0.3)
        assert log == ["first", "second", "later"]

    asyncio.run(body())
