"""Preparing a chunk for the wire: read it from the source, compress, checksum.

The first chunk of a transfer also fixes its compression (a trial on that
chunk, :class:`~kvbridge.transport.tcp.compress.CompressionPolicy`), limited
to what the receiver announced.  The work runs in worker threads (the pack
core, the compressors and xxhash release the GIL), except small raw chunks of
a source that lends its bytes, whose checksum is cheaper than a thread hop.
No chunk is kept once sent: a resend prepares it again from the source.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from ...wire.chunk import encode_chunk
from ...wire.frames import Capability, ChunkCodec
from .compress import CompressionDecision, CompressionPolicy
from .kvio import Source

__all__ = ["Encoded", "Preparer", "clamp", "read_chunk"]

INLINE_BYTES = 1 << 20  # raw chunk work up to this size runs on the event loop

# (offset, raw length, wire bytes, checksum) of one DATA frame's body
Encoded = tuple[int, int, Any, int]


class Preparer:
    """Prepares the DATA bodies of the transfers of one sender."""

    def __init__(self, pool: Executor, policy: CompressionPolicy) -> None:
        self.pool = pool
        self.policy = policy

    async def prepare(
        self, job: Any, pieces: list[tuple[int, int]], peer_caps: int
    ) -> list[Encoded]:
        """The bodies of ``pieces`` (``(offset, length)``) of ``job``'s source.
        ``job`` carries ``source``, ``total``, ``mode``, ``decision`` (None
        until the first chunk decided it), ``decide_lock`` and ``stats``."""
        loop = asyncio.get_running_loop()
        out: list[Encoded] = []
        if job.decision is None:
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
                    d = clamp(d, peer_caps)
                    job.decision = d
                    job.stats.compression = d.as_dict()
                    wire, ck = await loop.run_in_executor(
                        self.pool, encode_chunk, memoryview(raw), d.codec, d.shuffle
                    )
                    out.append((off, n, wire, ck))
                    pieces = pieces[1:]
        d = job.decision
        source = job.source
        inline = d.codec == ChunkCodec.RAW and hasattr(source, "view")
        for off, n in pieces:
            if inline and n <= INLINE_BYTES:
                # a checksum of a zero-copy view: cheaper than a hop to a worker thread
                wire, ck = _read_and_encode(source, off, n, d.codec, d.shuffle)
            else:
                wire, ck = await loop.run_in_executor(
                    self.pool, _read_and_encode, source, off, n, d.codec, d.shuffle
                )
            out.append((off, n, wire, ck))
        return out


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
    return encode_chunk(read_chunk(source, off, n), codec, shuffle)
