"""The receiver's write queue: verified chunks go into their sinks in order of
urgency, at most one per worker thread at a time.

The highest priority goes first, then the transfer with the fewest bytes
left, then arrival order, so that a small transfer is not queued behind a
large one here either.  Small raw chunks are written on the event loop (a
thread hop costs more): at once, as they arrive, when nothing is queued
(:meth:`WriteQueue.inline`); the rest (decompression, unpacking into pages)
in a worker thread, where the pack core, the decompressors and xxhash
release the GIL.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any

from ...errors import DecompressError
from ...wire.chunk import decode_chunk
from ...wire.frames import ChunkCodec, Data, Gathered
from .kvio import Sink

__all__ = ["INLINE_BYTES", "WriteQueue", "decode_and_write", "verifies_in_copy"]

INLINE_BYTES = 256 << 10  # raw chunks up to this size are written on the event loop

Job = Callable[[], Coroutine[Any, Any, None]]


class WriteQueue:
    def __init__(self, pool: Executor, workers: int) -> None:
        self.pool = pool
        self.workers = workers
        self._queue: list[tuple[int, int, int, Job]] = []
        self._seq = itertools.count()
        self._running = 0
        self.closing = False
        self.tasks: set[asyncio.Task[None]] = set()

    def inline(self, m: Data) -> bool:
        """Whether ``m`` is written at once, on the loop, without a task:
        a small raw chunk while nothing waits in the queue (so no more
        urgent chunk is passed over)."""
        return not self._queue and not self.closing and _small_raw(m)

    def push(self, priority: int, left: int, job: Job) -> None:
        heapq.heappush(self._queue, (-priority, left, next(self._seq), job))
        self._pump()

    def _pump(self) -> None:
        if self.closing:
            self._queue.clear()  # the transfers were failed by close()
            return
        while self._queue and self._running < self.workers:
            *_, job = heapq.heappop(self._queue)
            self._running += 1
            task = asyncio.get_running_loop().create_task(job())
            self.tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._running -= 1
        self._pump()

    async def write(self, sink: Sink, m: Data, pieces: tuple[tuple[int, int], ...]) -> None:
        """Verify and decode ``m`` and write ``pieces`` of it into ``sink``."""
        if _small_raw(m):
            decode_and_write(sink, m, pieces)  # cheaper than a hop to a worker thread
        else:
            await asyncio.get_running_loop().run_in_executor(
                self.pool, decode_and_write, sink, m, pieces
            )


def _small_raw(m: Data) -> bool:
    return m.codec == ChunkCodec.RAW and m.raw_length <= INLINE_BYTES


def verifies_in_copy(sink: Sink, codec: int, shuffle: int) -> bool:
    """Whether a chunk of this codec goes to ``sink`` through its
    ``write_checksummed``: the checksum checked in the pass that writes the
    bytes, so the receiver does not hash them on arrival."""
    return codec == ChunkCodec.RAW and not shuffle and hasattr(sink, "write_checksummed")


def decode_and_write(sink: Sink, m: Data, pieces: tuple[tuple[int, int], ...]) -> None:
    """Check ``m``'s checksum and codec (ChecksumError, DecompressError), then
    write the byte ranges ``pieces`` of it into ``sink``: a raw chunk that
    is written whole into a sink with ``write_checksummed`` is checked in
    that one pass."""
    a, b = m.offset, m.offset + m.raw_length
    data = m.data
    assert not isinstance(data, Gathered)  # only a sender's frames are gathered
    whole = len(pieces) == 1 and pieces[0] == (a, b)
    if whole and m.digest is None and verifies_in_copy(sink, m.codec, m.shuffle):
        if m.wire_length != m.raw_length:
            raise DecompressError(f"raw chunk of {m.wire_length} bytes, expected {m.raw_length}")
        sink.write_checksummed(a, data, m.checksum)  # type: ignore[attr-defined]
        return
    raw = decode_chunk(data, m.raw_length, m.codec, m.shuffle, m.checksum, m.digest)
    if whole:
        sink.write(a, raw)
        return
    mv = memoryview(raw)
    for x, y in pieces:
        sink.write(x, mv[x - a : y - a])
