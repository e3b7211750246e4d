"""A KV source that lends its pages: ``KVSource.views`` gives the runs of
cache memory that hold a slice's wire bytes, and the sender hashes those
runs and writes them with the frame header in one gathering write, without
packing them into a chunk first."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from tcp_support import arun, damaged_second_chunk

from kvbridge import pack
from kvbridge.layout import KVLayout
from kvbridge.transport.tcp import KVSink, KVSource, TcpReceiver, TcpSender, kvio
from kvbridge.wire.codec import FrameDecoder, encode_frame, encode_frame_parts
from kvbridge.wire.frames import Data, Gathered

KiB = 1 << 10


def _wire(src: KVSource) -> bytes:
    return bytes(np.asarray(src.range.pack()))


def _slices(n: int) -> list[tuple[int, int]]:
    return [(0, n), (3, min(n - 3, 65_541)), (n - 9, 9), (n // 2, n - n // 2), (7, 0)]


LAYOUTS = [
    dict(num_kv_heads=h, mla=mla, order=order, head_order=ho, stacked=st)
    for h, mla, order, ho, st in itertools.product(
        [1, 4], [False, True], ["kv_first", "page_first"], ["NHD", "HND"], [False, True]
    )
    if not (mla and (h > 1 or ho == "HND"))
]


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_the_views_of_a_slice_are_its_wire_bytes(kw: dict[str, Any], monkeypatch: Any) -> None:
    """For every memory order, head order, MLA and stacking, token range,
    layer range and head range: the runs ``views`` gives join to the bytes
    the pack core packs; a layout whose tokens' heads are not contiguous
    (HND with several heads) gives no views and is packed."""
    monkeypatch.setattr(kvio, "MIN_VIEW_RUN", 1)  # small pages here: lend them anyway
    lay = KVLayout(num_layers=3, head_dim=64, dtype="fp16", page_tokens=16, **kw)
    cache = pack.PagedKVCache.allocate(lay, 60, fill="random", seed=1)
    rng = np.random.default_rng(0)
    for (s, e), layers, heads in itertools.product(
        [(5, 700), (0, 16), (33, 34)], [None, (1, 3)], [None, (1, 3)]
    ):
        if heads is not None and lay.num_kv_heads < 3:
            continue
        bt = rng.permutation(60)[: lay.pages_for(e)].astype(np.int32)
        src = KVSource(cache, bt, s, e, layers, heads)
        lends = kw["head_order"] == "NHD" or lay.num_kv_heads == 1 or heads == (1, 2)
        assert hasattr(src, "views") == lends
        if not lends:
            continue
        want = _wire(src)
        for off, n in _slices(src.nbytes):
            assert b"".join(src.views(off, n)) == want[off : off + n]


def test_a_rank_caches_heads_and_blocks_of_several_pages(monkeypatch: Any) -> None:
    """A tensor-parallel rank's cache (heads 2..6 of 8) with 32-token blocks
    of 16-token pages, torch tensors: views of any head sub-range."""
    pytest.importorskip("torch")
    monkeypatch.setattr(kvio, "MIN_VIEW_RUN", 1)
    lay = KVLayout(
        num_layers=2, num_kv_heads=4, head_dim=64, dtype="bf16", page_tokens=16,
        head_start=2, model_kv_heads=8,
    )  # fmt: skip
    base = pack.PagedKVCache.allocate(lay, 64, backend="torch", fill="random", seed=3)
    assert base.backend == "torch"
    cache = pack.PagedKVCache(lay, base.tensors, block_tokens=32)
    bt = np.random.default_rng(1).permutation(32)[:20].astype(np.int32)
    for heads in [None, (3, 5), (2, 6), (5, 6)]:
        src = KVSource(cache, bt, 7, 600, None, heads)
        want = _wire(src)
        for off, n in _slices(src.nbytes):
            assert b"".join(src.views(off, n)) == want[off : off + n]


def test_short_runs_are_packed_and_adjacent_pages_merge() -> None:
    """Pages of 4 KiB in a shuffled table average under MIN_VIEW_RUN: no
    views.  The same pages in order are one run per layer (K's pages, then
    V's right after them in memory, as on the wire)."""
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
    cache = pack.PagedKVCache.allocate(lay, 64, fill="random", seed=2)
    shuffled = np.random.default_rng(2).permutation(64).astype(np.int32)
    assert not hasattr(KVSource(cache, shuffled, 0, 1024, None), "views")
    src = KVSource(cache, np.arange(64, dtype=np.int32), 0, 1024, None)
    assert len(src.views(0, src.nbytes)) == 2
    assert not hasattr(KVSource(cache, np.arange(64), 0, 1024, None, zero_copy=False), "views")


def test_a_gathered_body_is_the_same_frame_as_one_buffer() -> None:
    body = bytes(range(256)) * 40
    parts = [memoryview(body)[:100], memoryview(body)[100:5000], memoryview(body)[5000:]]
    one = Data(3, 1, 4096, len(body), 0, 0, 77, body, head_check=True)
    many = Data(3, 1, 4096, len(body), 0, 0, 77, Gathered(parts), head_check=True)
    assert many.wire_length == len(body)
    frame = encode_frame(one)
    assert b"".join(bytes(p) for p in encode_frame_parts(many)) == frame
    dec = FrameDecoder()
    dec.data_check = True
    (m,) = dec.feed(frame)
    assert bytes(m.data) == body


def _big_pages(seed: int) -> tuple[Any, Any, Any, Any]:
    """32 KiB pages (16 tokens of 8 heads of 128 fp16), shuffled at both ends."""
    lay = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    rng = np.random.default_rng(seed)
    src = pack.PagedKVCache.allocate(lay, 80, fill="random", seed=seed)
    dst = pack.PagedKVCache.allocate(lay, 80)
    return src, dst, rng.permutation(80).astype(np.int32), rng.permutation(80).astype(np.int32)


def test_kv_pages_leave_the_sender_without_a_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender writes the cache's own pages (no pack on the sending side)
    and the destination pages end up equal to the source's."""
    src, dst, src_bt, dst_bt = _big_pages(5)
    packs: list[int] = []
    real = pack.KVRange.pack

    def counting(self: Any, *a: Any, **kw: Any) -> Any:
        packs.append(1)
        return real(self, *a, **kw)

    async def main() -> None:
        rx = await TcpReceiver().start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2, chunk_size=256 * KiB, compression="off")
        source, sink = KVSource(src, src_bt, 3, 1200, None), KVSink(dst, dst_bt, 3, 1200, None)
        assert hasattr(source, "views")
        want = _wire(source)
        monkeypatch.setattr(pack.KVRange, "pack", counting)
        h = rx.expect("kv", sink)
        st = await tx.send("kv", source, token=h.token).wait(20)
        await h.wait(20)
        monkeypatch.undo()
        assert st.bytes == source.nbytes and st.chunks == -(-source.nbytes // (256 * KiB))
        assert packs == []
        assert bytes(np.asarray(pack.pack(dst, dst_bt, 3, 1200))) == want
        await tx.close()
        await rx.close()

    arun(main(), 60)


def test_a_damaged_lent_chunk_is_sent_again_from_the_pages() -> None:
    src, dst, src_bt, dst_bt = _big_pages(6)

    async def main() -> None:
        rx = await TcpReceiver().start()
        proxy, tx = await damaged_second_chunk(rx, 128 * KiB)
        source, sink = KVSource(src, src_bt, 0, 1280, None), KVSink(dst, dst_bt, 0, 1280, None)
        assert hasattr(source, "views")
        h = rx.expect("kv", sink)
        st = await tx.send("kv", source, token=h.token).wait(30)
        await h.wait(5)
        assert proxy.stats.frames_corrupted == 1
        assert st.retries >= 1 and h.stats.bad_chunks == 1
        assert bytes(np.asarray(pack.pack(dst, dst_bt, 0, 1280))) == _wire(source)
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main(), 60)


def test_a_layerwise_source_lends_only_the_layers_that_are_ready() -> None:
    import threading

    from kvbridge.bridge.layerwise import LayerwiseSource
    from kvbridge.errors import TransferTimeout

    src, _, src_bt, _ = _big_pages(7)
    source = LayerwiseSource(src, src_bt, 0, 1000, None, layer_timeout=0.2)
    assert hasattr(source, "views")
    per_layer = source.nbytes // 2
    with pytest.raises(TransferTimeout):
        source.views(0, 10)
    source.mark_ready(1)
    source.views(0, per_layer)  # layer 0 only: no wait
    late = threading.Timer(0.05, source.mark_ready, (2,))
    late.start()
    got = b"".join(source.views(per_layer - 5, 10))  # waits for layer 1
    late.join()
    assert got == _wire(source)[per_layer - 5 : per_layer + 5]
