"""Real KV pages through the transport: pack on the sender, unpack on the
receiver, between different page sizes and memory orders (needs the pack core)."""

from __future__ import annotations

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.errors import BufferTooSmall
from kvbridge.layout import KVLayout
from kvbridge.transport.tcp import (
    BytesSink,
    BytesSource,
    KVSink,
    KVSource,
    TcpReceiver,
    TcpSender,
)

pytest.importorskip("kvbridge._core")
pack = pytest.importorskip("kvbridge.pack")

SRC = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
DST = SRC.replace(page_tokens=64, order="page_first", head_order="HND")


@pytest.mark.parametrize("layers", [None, (1, 3)])
@pytest.mark.parametrize("compression", ["off", "zstd"])
def test_kv_pages_round_trip_between_layouts(
    layers: tuple[int, int] | None, compression: str
) -> None:
    start, end = 5, 700
    src = pack.PagedKVCache.allocate(SRC, 60, fill="random", seed=3)
    dst = pack.PagedKVCache.allocate(DST, 20)
    rng = np.random.default_rng(0)
    src_table = rng.permutation(60)[: SRC.pages_for(end)].astype(np.int32)
    dst_table = rng.permutation(20)[: DST.pages_for(end)].astype(np.int32)

    async def main() -> None:
        rx = await TcpReceiver(compat_hash=DST.compat_hash).start()
        tx = TcpSender(
            "127.0.0.1", rx.port, compat_hash=SRC.compat_hash, streams=3, chunk_size=64 << 10
        )
        sink = KVSink(dst, dst_table, start, end, layers)
        source = KVSource(src, src_table, start, end, layers)
        assert sink.nbytes == source.nbytes and source.itemsize == 2
        h = rx.expect("req", sink)
        stats = await tx.send("req", source, token=h.token, compression=compression).wait(30)
        await h.wait(30)
        assert stats.bytes == source.nbytes
        want = pack.pack(src, src_table, start, end, layers=layers)
        got = pack.pack(dst, dst_table, start, end, layers=layers)
        assert bytes(np.asarray(want)) == bytes(np.asarray(got))
        await tx.close()
        await rx.close()

    arun(main())


def test_kv_source_read_fills_a_fresh_buffer_like_read_into() -> None:
    src = pack.PagedKVCache.allocate(SRC, 40, fill="random", seed=5)
    table = np.random.default_rng(1).permutation(40)[: SRC.pages_for(500)].astype(np.int32)
    source = KVSource(src, table, 3, 500, None)
    want = bytes(np.asarray(pack.pack(src, table, 3, 500)))
    for off, n in [(0, source.nbytes), (1, 4097), (source.nbytes - 7, 7), (100, 0)]:
        got = source.read(off, n)
        assert len(got) == n and bytes(got) == want[off : off + n]
        into = bytearray(n)
        source.read_into(off, memoryview(into))
        assert bytes(into) == want[off : off + n]
    with pytest.raises(BufferTooSmall):
        source.read(source.nbytes - 3, 4)
    with pytest.raises(BufferTooSmall):
        source.read(-1, 4)


def test_sender_takes_the_buffer_a_source_reads() -> None:
    """A source with ``read`` is asked for each chunk through it (no zero-filled
    buffer and read_into), and the bytes arrive intact."""
    data = np.random.default_rng(2).integers(0, 256, 300_000, dtype=np.uint8).tobytes()

    class ReadSource(BytesSource):
        view = None  # type: ignore[assignment]

        def __init__(self) -> None:
            super().__init__(data)
            self.reads = 0

        def read(self, offset: int, n: int) -> memoryview:
            self.reads += 1
            return memoryview(np.frombuffer(data, np.uint8)[offset : offset + n].copy())

        def read_into(self, offset: int, out: memoryview) -> None:
            raise AssertionError("read_into used although the source offers read")

    async def main() -> None:
        rx = await TcpReceiver().start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2, chunk_size=64 << 10)
        source = ReadSource()
        sink = BytesSink(len(data))
        h = rx.expect("r", sink)
        await tx.send("r", source, token=h.token, compression="off").wait(30)
        await h.wait(30)
        assert bytes(sink.data) == data
        assert source.reads == 5  # ceil(300_000 / 64 KiB)
        await tx.close()
        await rx.close()

    arun(main())


def test_kv_source_and_sink_take_the_pack_cores_thread_count() -> None:
    """One pack or unpack thread per chunk by default (the transport already
    runs one chunk per worker thread); any count gives the same bytes, and a
    negative one is refused up front."""
    from kvbridge.errors import InvalidArgument

    src = pack.PagedKVCache.allocate(SRC, 40, fill="random", seed=7)
    table = np.random.default_rng(3).permutation(40)[: SRC.pages_for(600)].astype(np.int32)
    want = bytes(np.asarray(pack.pack(src, table, 0, 600)))
    assert KVSource(src, table, 0, 600, None).num_threads == 1
    for nt in (0, 1, 2):
        source = KVSource(src, table, 0, 600, None, num_threads=nt)
        assert bytes(source.read(0, source.nbytes)) == want
        dst = pack.PagedKVCache.allocate(SRC, 40)
        sink = KVSink(dst, table, 0, 600, None, num_threads=nt)
        sink.write(0, memoryview(want))
        assert bytes(np.asarray(pack.pack(dst, table, 0, 600))) == want
    with pytest.raises(InvalidArgument):
        KVSource(src, table, 0, 600, None, num_threads=-1)
    with pytest.raises(InvalidArgument):
        KVSink(src, table, 0, 600, None, num_threads=-1)
