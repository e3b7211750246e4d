"""Preparing a chunk for the wire: read it from the source, compress, checksum.

The first chunk of a transfer also fixes its compression (a trial on that
chunk, :class:`~kvbridge.transport.tcp.compress.CompressionPolicy`), limited
to what the receiver announced; when the decision needs no trial (compression
off or configured, a small transfer, an unknown or too fast link) it is made
at once, without reading anything.  The work runs in worker threads (the pack
core, the compressors and xxhash release the GIL), except small raw chunks
that the source can give on the event loop (:func:`inline_limit`): their work
is cheaper than a hop to a worker thread and back.  No chunk is kept once
sent: a resend prepares it again from the source.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from ...wire.chunk import checksum_parts, encode_chunk
from ...wire.frames import Capability, ChunkCodec, Gathered
from .compress import CompressionDecision, CompressionPolicy
from .kvio import Source

__all__ = ["INLINE_BYTES", "INLINE_READ_BYTES", "Encoded", "Preparer", "clamp", "read_chunk"]

INLINE_BYTES = 1 << 20  # raw chunks of a source that lends its bytes: checksummed on the loop
INLINE_READ_BYTES = 256 << 10  # raw chunks a source fills on the loop (``read_on_loop``)

# (offset, raw length, wire bytes, checksum) of one DATA frame's body
Encoded = tuple[int, int, Any, int]


def inline_limit(source: Source) -> int:
    """The largest raw chunk of ``source`` prepared on the event loop: a
    source that lends its bytes (``view``) costs one checksum pass; one that
    fills a buffer (``read``) may say that it does so without blocking
    (``read_on_loop``: a CPU pack, not a CUDA copy); others go to a worker."""
    if getattr(source, "view", None) is not None:
        return INLINE_BYTES
    if getattr(source, "read_on_loop", False) and (
        hasattr(source, "read") or hasattr(source, "read_checksummed")
    ):
        return INLINE_READ_BYTES
    return 0


class Preparer:
    """Prepares the DATA bodies of the transfers of one sender.  A ``job``
    carries ``source``, ``total``, ``mode``, ``decision`` (None until the
    first chunk decided it), ``decide_lock`` and ``stats``."""

    def __init__(self, pool: Executor, policy: CompressionPolicy) -> None:
        self.pool = pool
        self.policy = policy

    def decide_now(self, job: Any, peer_caps: int) -> bool:
        """Fix ``job``'s compression now if that needs no trial; whether it is fixed."""
        if job.decision is None:
            d = self.policy.without_trial(job.source.itemsize, job.total, job.mode)
            if d is None:
                return False
            self._set(job, clamp(d, peer_caps))
        return True

    def inline(self, job: Any, pieces: list[tuple[int, int]], peer_caps: int) -> bool:
        """Whether ``pieces`` of ``job`` are prepared on the event loop."""
        if not self.decide_now(job, peer_caps) or job.decision.codec != ChunkCodec.RAW:
            return False
        limit = inline_limit(job.source)
        return all(n <= limit for _, n in pieces)

    def encode(self, job: Any, pieces: list[tuple[int, int]]) -> list[Encoded]:
        """The bodies of ``pieces`` in this thread (its decision is fixed)."""
        d = job.decision
        return [
            (off, n, *_read_and_encode(job.source, off, n, d.codec, d.shuffle)) for off, n in pieces
        ]

    async def prepare(
        self, job: Any, pieces: list[tuple[int, int]], peer_caps: int
    ) -> list[Encoded]:
        """The bodies of ``pieces`` (``(offset, length)``) of ``job``'s source."""
        loop = asyncio.get_running_loop()
        out: list[Encoded] = []
        if not self.decide_now(job, peer_caps):
            async with job.decide_lock:
                if job.decision is None:
                    off, n = pieces[0]
                    raw = await loop.run_in_executor(self.pool, read_chunk, job.source, off, n)
                    d = await loop.run_in_executor(
                        self.pool,
                        self.policy.decide,
                        memoryview(raw),
                        job.source.itemsize,
                        job.total,
                        job.mode,
                    )
                    self._set(job, clamp(d, peer_caps))
                    wire, ck = await loop.run_in_executor(
                        self.pool, encode_chunk, memoryview(raw), d.codec, d.shuffle
                    )
                    out.append((off, n, wire, ck))
                    pieces = pieces[1:]
        d = job.decision
        limit = inline_limit(job.source) if d.codec == ChunkCodec.RAW else 0
        for off, n in pieces:
            if n <= limit:
                wire, ck = _read_and_encode(job.source, off, n, d.codec, d.shuffle)
            else:
                wire, ck = await loop.run_in_executor(
                    self.pool, _read_and_encode, job.source, off, n, d.codec, d.shuffle
                )
            out.append((off, n, wire, ck))
        return out

    @staticmethod
    def _set(job: Any, d: CompressionDecision) -> None:
        job.decision = d
        job.stats.compression = d.as_dict()


def clamp(d: CompressionDecision, caps: int) -> CompressionDecision:
    """Use only what the receiver announced in its HELLO_ACK."""
    need = {ChunkCodec.LZ4: Capability.LZ4, ChunkCodec.ZSTD: Capability.ZSTD}.get(
        ChunkCodec(d.codec), 0
    )
    if need and not caps & need:
        d.codec, d.reason = ChunkCodec.RAW, f"receiver lacks {ChunkCodec(d.codec).name}"
    if d.shuffle and (d.codec == ChunkCodec.RAW or not caps & Capability.SHUFFLE2):
        d.shuffle = 0
    return d


def read_chunk(source: Source, off: int, n: int) -> Any:
    """The bytes ``[off, off + n)`` of ``source``, copied as little as it allows."""
    view = getattr(source, "view", None)
    if view is not None:
        return view(off, n)  # bytes already in wire form: no copy
    read = getattr(source, "read", None)
    if read is not None:
        return read(off, n)  # a buffer the source filled: no zero-fill
    raw = bytearray(n)
    source.read_into(off, memoryview(raw))
    return raw


def _read_and_encode(source: Source, off: int, n: int, codec: int, shuffle: int) -> tuple[Any, int]:
    if codec == ChunkCodec.RAW and not shuffle:
        views = getattr(source, "views", None)
        if views is not None:  # runs of the source's own memory: hashed, never copied
            parts = views(off, n)
            if parts is not None:
                return Gathered(parts), checksum_parts(parts)
        one_pass = getattr(source, "read_checksummed", None)
        if one_pass is not None:  # the bytes and their checksum from one pass
            data, ck = one_pass(off, n)
            return data, int(ck)
    return encode_chunk(read_chunk(source, off, n), codec, shuffle)
