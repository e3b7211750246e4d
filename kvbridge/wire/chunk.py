"""Chunk bodies: byte shuffle, lz4 / zstd compression and the xxh3-64 checksum.

Exactly as docs/protocol.md specifies:

* the checksum is XXH3-64 (seed 0) of the *wire* bytes of the chunk (after
  shuffle and compression), written as a u64;
* ``shuffle = 2`` splits the first ``2 * (n // 2)`` raw bytes into the low
  bytes of each 2-byte element followed by the high bytes; an odd last byte
  stays last.  ``shuffle = 0`` is no shuffle;
* codec 1 is an LZ4 *block* (no frame header, no size prefix); codec 2 is a
  zstd frame (RFC 8878).  Decompressed size must equal ``raw_length``.
"""

from __future__ import annotations

import threading

import lz4.block
import numpy as np
import xxhash
import zstandard

from ..errors import ChecksumError, DecompressError, InvalidArgument, RemoteProtocolError
from .frames import ChunkCodec

__all__ = ["checksum", "checksum_parts", "decode_chunk", "encode_chunk", "shuffle2", "unshuffle2"]

_LOCAL = threading.local()  # zstd contexts are not thread-safe: one per thread


def _zstd_d() -> zstandard.ZstdDecompressor:
    d = getattr(_LOCAL, "d", None)
    if d is None:
        d = _LOCAL.d = zstandard.ZstdDecompressor()
    return d


def _zstd_c() -> zstandard.ZstdCompressor:
    c = getattr(_LOCAL, "c", None)
    if c is None:
        c = _LOCAL.c = zstandard.ZstdCompressor(level=1)
    return c


def checksum(data: bytes | bytearray | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def checksum_parts(parts: list[memoryview]) -> int:
    """The checksum of the concatenation of ``parts``, without joining them
    (XXH3-64 streamed over each part in turn equals it over the whole)."""
    if len(parts) == 1:
        return checksum(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return int(h.intdigest())


def shuffle2(raw: bytes | bytearray | memoryview) -> bytes:
    a = np.frombuffer(raw, dtype=np.uint8)
    even = len(a) & ~1
    pairs = a[:even].reshape(-1, 2)
    return b"".join((pairs[:, 0].tobytes(), pairs[:, 1].tobytes(), a[even:].tobytes()))


def unshuffle2(data: bytes | bytearray | memoryview, out: memoryview | None = None) -> memoryview:
    a = np.frombuffer(data, dtype=np.uint8)
    even = len(a) & ~1
    half = even // 2
    res = np.empty(len(a), dtype=np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
    pairs = res[:even].reshape(-1, 2)
    pairs[:, 0] = a[:half]
    pairs[:, 1] = a[half:even]
    res[even:] = a[even:]
    return res.data.cast("B")


def encode_chunk(
    raw: bytes | bytearray | memoryview, codec: int = ChunkCodec.RAW, shuffle: int = 0
) -> tuple[bytes | bytearray | memoryview, int]:
    """``(wire bytes, checksum)`` of one chunk."""
    body: bytes | bytearray | memoryview = shuffle2(raw) if shuffle == 2 else raw
    if codec == ChunkCodec.LZ4:
        body = lz4.block.compress(body, store_size=False)
    elif codec == ChunkCodec.ZSTD:
        body = _zstd_c().compress(body)
    elif codec != ChunkCodec.RAW:
        raise InvalidArgument(f"unknown chunk codec {codec}")
    return body, checksum(body)


def _zstd_decode(data: bytes | bytearray | memoryview, raw_length: int) -> bytes:
    """One zstd frame that decodes to exactly ``raw_length`` bytes, never
    allocating more: a frame that declares another size is refused before
    anything is allocated (a bomb: a small body declaring gigabytes), one
    without a declared size is bounded by ``raw_length``, and bytes after the
    frame are refused too."""
    declared = zstandard.frame_content_size(data)
    if declared not in (-1, raw_length):
        raise DecompressError(f"zstd frame declares {declared} bytes, expected {raw_length}")
    d = _zstd_d()
    if declared == -1:  # bounded first; then the same, now known small, frame for its end
        d.decompress(data, max_output_size=raw_length)
    obj = d.decompressobj()
    body = obj.decompress(data)
    if obj.unused_data or not obj.eof:
        raise DecompressError("bytes after the zstd frame, or a frame cut short")
    return body


def decode_chunk(
    data: bytes | bytearray | memoryview,
    raw_length: int,
    codec: int,
    shuffle: int,
    expected_checksum: int,
    digest: int | None = None,
) -> memoryview:
    """Verify and decode one chunk into its raw bytes.

    Raises :class:`ChecksumError` when the checksum does not match, its
    subclass :class:`DecompressError` when the body does not decode to exactly
    ``raw_length`` bytes (both mean a damaged chunk that the receiver asks for
    again: NACK CHECKSUM or DECOMPRESS), :class:`RemoteProtocolError` for an
    unknown codec or shuffle.  ``digest`` is the checksum of ``data`` when the
    caller already computed it (as the bytes arrived).
    """
    if shuffle not in (0, 2):
        raise RemoteProtocolError(f"unknown shuffle {shuffle}")
    if codec not in (ChunkCodec.RAW, ChunkCodec.LZ4, ChunkCodec.ZSTD):
        raise RemoteProtocolError(f"unknown chunk codec {codec}")
    if (checksum(data) if digest is None else digest) != expected_checksum:
        raise ChecksumError("chunk checksum mismatch")
    body: bytes | bytearray | memoryview
    if codec == ChunkCodec.RAW:
        body = data
    else:
        try:
            if codec == ChunkCodec.LZ4:
                body = lz4.block.decompress(data, uncompressed_size=raw_length)
            else:
                body = _zstd_decode(data, raw_length)
        except DecompressError:
            raise
        except Exception as e:
            raise DecompressError(f"chunk does not decompress: {e}") from None
    if len(body) != raw_length:
        raise DecompressError(f"chunk decodes to {len(body)} bytes, expected {raw_length}")
    if shuffle == 2:
        return unshuffle2(body)
    return memoryview(body).cast("B")
