"""Chunk bodies: shuffle, lz4 block, zstd, xxh3-64 checksums."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import ChecksumError, RemoteProtocolError
from kvbridge.wire.chunk import checksum, decode_chunk, encode_chunk, shuffle2, unshuffle2
from kvbridge.wire.frames import ChunkCodec


def kv_like(n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, n // 2).astype(np.float16).tobytes()


def test_shuffle_layout_exact() -> None:
    assert shuffle2(b"\x01\x02\x03\x04\x05") == b"\x01\x03\x02\x04\x05"
    assert bytes(unshuffle2(b"\x01\x03\x02\x04\x05")) == b"\x01\x02\x03\x04\x05"


def test_checksum_is_xxh3_64_seed0() -> None:
    # XXH3-64 of the empty input (the reference value of the xxHash spec)
    assert checksum(b"") == 0x2D06800538D394C2


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=5000), st.sampled_from(list(ChunkCodec)), st.sampled_from([0, 2]))
def test_round_trip(raw: bytes, codec: ChunkCodec, shuffle: int) -> None:
    wire, ck = encode_chunk(raw, codec, shuffle)
    assert bytes(decode_chunk(wire, len(raw), codec, shuffle, ck)) == raw


def test_shuffle_helps_zstd_on_fp16() -> None:
    raw = kv_like(1 << 20)
    plain, _ = encode_chunk(raw, ChunkCodec.ZSTD, 0)
    shuf, _ = encode_chunk(raw, ChunkCodec.ZSTD, 2)
    assert len(shuf) < len(plain)


@pytest.mark.parametrize("codec", list(ChunkCodec))
def test_every_flipped_bit_is_caught(codec: ChunkCodec) -> None:
    raw = kv_like(4096)
    wire, ck = encode_chunk(raw, codec, 2)
    for pos in range(0, len(wire), max(1, len(wire) // 50)):
        bad = bytearray(wire)
        bad[pos] ^= 0x10
        with pytest.raises(ChecksumError):
            decode_chunk(bytes(bad), len(raw), codec, 2, ck)


def test_wrong_raw_length_and_bad_codec() -> None:
    wire, ck = encode_chunk(b"x" * 100, ChunkCodec.ZSTD)
    with pytest.raises(ChecksumError):
        decode_chunk(wire, 99, ChunkCodec.ZSTD, 0, ck)
    with pytest.raises(ChecksumError):
        decode_chunk(b"abc", 4, ChunkCodec.RAW, 0, checksum(b"abc"))
    with pytest.raises(RemoteProtocolError):
        decode_chunk(b"abc", 3, 9, 0, checksum(b"abc"))
    with pytest.raises(RemoteProtocolError):
        decode_chunk(b"abc", 3, 0, 4, checksum(b"abc"))


def test_concurrent_decoding_from_threads() -> None:
    # zstd contexts are not thread-safe; the receiver decodes on a thread pool
    from concurrent.futures import ThreadPoolExecutor

    raws = [kv_like(256 * 1024, seed=i) for i in range(16)]
    encoded = [encode_chunk(r, ChunkCodec.ZSTD, 2) for r in raws]

    def work(i: int) -> bool:
        w, ck = encoded[i % 16]
        return bytes(decode_chunk(w, len(raws[i % 16]), ChunkCodec.ZSTD, 2, ck)) == raws[i % 16]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(128)))


def test_zstd_bombs_and_trailing_bytes_are_refused() -> None:
    """A small zstd body declaring far more than raw_length is refused from its
    header, before anything is allocated; so are bytes after the frame; a frame
    without a declared size is bounded by raw_length."""
    import zstandard

    from kvbridge.errors import DecompressError

    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
    assert len(bomb) < 1 << 20 and zstandard.frame_content_size(bomb) == 64 << 20
    with pytest.raises(DecompressError, match="declares"):
        decode_chunk(bomb, 1 << 16, ChunkCodec.ZSTD, 0, checksum(bomb))
    ok = zstandard.ZstdCompressor(level=1).compress(b"a" * 1000)
    assert bytes(decode_chunk(ok, 1000, ChunkCodec.ZSTD, 0, checksum(ok))) == b"a" * 1000
    for tail in (ok, b"junk"):
        body = ok + tail
        with pytest.raises(DecompressError):
            decode_chunk(body, 1000, ChunkCodec.ZSTD, 0, checksum(body))
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False)
    big = unsized.compress(bytes(16 << 20))
    with pytest.raises(DecompressError):
        decode_chunk(big, 1 << 16, ChunkCodec.ZSTD, 0, checksum(big))
    small = unsized.compress(b"b" * 500)
    assert bytes(decode_chunk(small, 500, ChunkCodec.ZSTD, 0, checksum(small))) == b"b" * 500
