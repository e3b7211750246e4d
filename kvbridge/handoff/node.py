"""A node's message pump: decodes a channel's payloads and routes them to
per-request inboxes (sans-IO codecs, asyncio plumbing)."""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType

from ..errors import PeerGone, ProtocolError
from .channel import MessageChannel
from .messages import HandoffMessage, decode, encode

__all__ = ["HandoffNode"]

MAX_EARLY_REQUESTS = 1024
MAX_EARLY_MESSAGES = 64


class HandoffNode:
    """Routes the handoff messages that reach ``channel`` to the request they
    name.  Messages for a request that has no inbox yet wait until it opens
    one (at most 64 per request, for the 1024 most recent such requests); malformed payloads are counted in :attr:`rejected` and
    dropped.  Use as ``async with HandoffNode(channel) as node``."""

    def __init__(self, channel: MessageChannel, *, poll_interval: float = 0.05) -> None:
        self.channel = channel
        self.name = channel.name
        self.poll_interval = poll_interval
        self.rejected = 0
        self.gone: BaseException | None = None
        self._inboxes: dict[int, asyncio.Queue[HandoffMessage]] = {}
        self._early: dict[int, deque[HandoffMessage]] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def __aenter__(self) -> HandoffNode:
        self._task = asyncio.create_task(self._pump(), name=f"handoff-node-{self.name}")
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            # The flag ends the pump even if a wait_for inside the channel swallows
            # the cancellation (a known asyncio race before Python 3.12).
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def open(self, request_id: int) -> asyncio.Queue[HandoffMessage]:
        """The inbox of a request (messages that came early are in it)."""
        q: asyncio.Queue[HandoffMessage] = asyncio.Queue()
        for msg in self._early.pop(request_id, ()):
            q.put_nowait(msg)
        self._inboxes[request_id] = q
        return q

    def close(self, request_id: int) -> None:
        self._inboxes.pop(request_id, None)

    async def send(self, dst: str, msg: HandoffMessage) -> None:
        await self.channel.send(dst, int(msg.KIND), encode(msg))

    async def _pump(self) -> None:
        while not self._stopping:
            try:
                gram = await self.channel.recv(self.poll_interval)
            except PeerGone as e:
                self.gone = e
                return
            if gram is None:
                continue
            try:
                msg = decode(gram.payload, gram.frame_type)
            except ProtocolError:
                self.rejected += 1
                continue
            q = self._inboxes.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)
            else:
                if msg.request_id not in self._early and len(self._early) >= MAX_EARLY_REQUESTS:
                    del self._early[next(iter(self._early))]  # forget the oldest orphan
                self._early.setdefault(msg.request_id, deque(maxlen=MAX_EARLY_MESSAGES)).append(msg)
