"""Real KV pages through the transport: pack on the sender, unpack on the
receiver, between different page sizes and memory orders (needs the pack core)."""

from __future__ import annotations

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.layout import KVLayout
from kvbridge.transport.tcp import KVSink, KVSource, TcpReceiver, TcpSender

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
