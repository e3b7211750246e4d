"""One way to bound an await with a deadline of kvbridge's own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .errors import KVBridgeError

T = TypeVar("T")


async def wait_within(
    aw: Awaitable[T], timeout: float | None, on_timeout: Callable[[], KVBridgeError]
) -> T:
    """``await aw`` for at most ``timeout`` seconds (None: no limit here).

    When this deadline passes, ``on_timeout()`` is raised.  A kvbridge timeout
    that ``aw`` raised itself (say, the transfer's own deadline: our timeout
    errors are also ``TimeoutError``) passes through unchanged, so that its
    message names the deadline that really passed.
    """
    try:
        return await asyncio.wait_for(aw, timeout)
    except TimeoutError as e:
        if isinstance(e, KVBridgeError):
            raise
        raise on_timeout() from None
