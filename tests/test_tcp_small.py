"""The short way of a small transfer: its chunk leaves with its OPEN in one
write, nothing hops to a worker thread and no task is created; the receiver
answers the read that brought them with one write (RESUME, ACK, COMPLETE)
once the bytes are in the sink.  And what must not change: a cancel right
after send() still stops it, a busy sender still schedules, a sink whose
flush may block is still flushed in a worker thread."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from tcp_support import OnceSink, arun, damaged_second_chunk

from kvbridge.transport.tcp import BytesSink, BytesSource, TcpReceiver, TcpSender
from kvbridge.wire.codec import FrameDecoder
from kvbridge.wire.frames import Ack, Complete, Data, Open, Resume

KiB = 1 << 10


class _Writes:
    """Wraps a connection's transport: records each write call's bytes."""

    def __init__(self, transport: Any) -> None:
        self._t = transport
        self.calls: list[bytes] = []

    def write(self, data: Any) -> None:
        self.calls.append(bytes(data))
        self._t.write(data)

    def writelines(self, parts: Any) -> None:
        parts = list(parts)
        self.calls.append(b"".join(bytes(p) for p in parts))
        self._t.writelines(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def _frames(data: bytes, version: int = 1) -> list[Any]:
    dec = FrameDecoder()
    dec.version = version
    dec.data_check = True
    return dec.feed(data)


@contextmanager
def _counting(*pools: Any) -> Iterator[list[str]]:
    """Names of the callables submitted to ``pools`` (worker-thread hops)."""
    seen: list[str] = []
    saved = []
    for pool in pools:
        orig = pool.submit

        def submit(fn: Any, *a: Any, _orig: Any = orig, **k: Any) -> Any:
            seen.append(getattr(fn, "__name__", repr(fn)))
            return _orig(fn, *a, **k)

        pool.submit = submit
        saved.append((pool, orig))
    try:
        yield seen
    finally:
        for pool, orig in saved:
            pool.submit = orig


async def _pair(streams: int = 1, **tx_kw: Any) -> tuple[TcpReceiver, TcpSender]:
    rx = await TcpReceiver().start()
    tx = await TcpSender("127.0.0.1", rx.port, streams=streams, **tx_kw).connect()
    await asyncio.sleep(0.05)  # the receiver's side of every handshake is done
    return rx, tx


@pytest.mark.parametrize("size", [1, 4 * KiB, 64 * KiB])
def test_a_small_transfer_is_one_write_each_way_without_threads_or_tasks(size: int) -> None:
    async def main() -> None:
        rx, tx = await _pair(compression="off")
        (link,) = tx._links.live
        sent = _Writes(link.conn.transport)
        link.conn.transport = sent  # type: ignore[assignment]
        (rconn,) = rx._conns
        replies = _Writes(rconn.transport)
        rconn.transport = replies  # type: ignore[assignment]
        data = os.urandom(size)
        sink = BytesSink(size)
        h = rx.expect("r", sink)
        loop = asyncio.get_running_loop()
        tasks: list[Any] = []
        loop.set_task_factory(
            lambda lp, coro, **kw: tasks.append(coro) or asyncio.Task(coro, loop=lp, **kw)
        )
        with _counting(tx._pool, rx._pool) as hops:
            st = await tx.send("r", BytesSource(data), token=h.token).wait(10)
            await h.wait(10)
        loop.set_task_factory(None)
        assert bytes(sink.data) == data and st.chunks == 1
        assert hops == [] and tasks == []
        (out,) = sent.calls  # OPEN and DATA in one write
        assert [type(m) for m in _frames(out)] == [Open, Data]
        # RESUME, ACK and COMPLETE in one write when OPEN and DATA came in one
        # read; a larger DATA frame may take more reads: then RESUME answers
        # the first and ACK + COMPLETE the last, together
        assert [type(m) for m in _frames(b"".join(replies.calls))] == [Resume, Ack, Complete]
        assert [type(m) for m in _frames(replies.calls[-1])][-2:] == [Ack, Complete]
        if size <= 4 * KiB:
            assert len(replies.calls) == 1
        await tx.close()
        await rx.close()

    arun(main())


def test_a_kv_source_and_sink_take_the_short_way_too() -> None:
    pack = pytest.importorskip("kvbridge.pack")
    from kvbridge.layout import KVLayout
    from kvbridge.transport.tcp import KVSink, KVSource

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
    src = pack.PagedKVCache.allocate(lay, 8, fill="random", seed=1)
    dst = pack.PagedKVCache.allocate(lay, 8)
    table = np.arange(8, dtype=np.int32)

    async def main() -> None:
        rx, tx = await _pair(compression="off")
        source = KVSource(src, table, 0, 40, None)
        assert source.read_on_loop and KVSink.flush_on_loop
        h = rx.expect("kv", KVSink(dst, table[::-1].copy(), 0, 40, None))
        with _counting(tx._pool, rx._pool) as hops:
            await tx.send("kv", source, token=h.token).wait(10)
            await h.wait(10)
        assert hops == []  # packed on the sender's loop, unpacked on the receiver's
        want = pack.pack(src, table, 0, 40)
        got = pack.pack(dst, table[::-1].copy(), 0, 40)
        assert bytes(np.asarray(want)) == bytes(np.asarray(got))
        await tx.close()
        await rx.close()

    arun(main())


def test_a_sink_whose_flush_may_block_is_flushed_in_a_worker_thread() -> None:
    class SlowFlush(BytesSink):
        flush_on_loop = False

        def flush(self) -> None:
            self.thread = threading.current_thread().name
            super().flush()

    class QuickFlush(SlowFlush):
        flush_on_loop = True

    async def main() -> None:
        rx, tx = await _pair()
        for cls, on_loop in ((SlowFlush, False), (QuickFlush, True)):
            sink = cls(100)
            h = rx.expect(cls.__name__, sink)
            await tx.send(cls.__name__, BytesSource(b"x" * 100), token=h.token).wait(10)
            await h.wait(10)
            assert (sink.thread == threading.current_thread().name) is on_loop
            assert sink.flushed
        await tx.close()
        await rx.close()

    arun(main())


def test_small_transfers_behind_a_busy_connection_wait_for_the_scheduler() -> None:
    """While chunks wait to be sent, a new small transfer does not jump the
    queue on its own: the scheduler picks (srpt: it still goes first)."""

    async def main() -> None:
        rx, tx = await _pair(chunk_size=256 * KiB, scheduler="fifo")
        # more than the kernel takes in without a read (a 4 MiB send buffer
        # and up to 32 MiB of receive buffer on loopback): with 8 MiB, 2 of 15
        # runs on a 2-core AMD EPYC VM had no chunk left waiting by the time
        # the small transfer began, so it rightly went at once
        big = os.urandom(64 << 20)
        hb = rx.expect("big", OnceSink(len(big)))
        sb = tx.send("big", BytesSource(big), token=hb.token)
        while sb.acked_bytes < 256 * KiB:
            await asyncio.sleep(0.001)
        assert not tx.scheduler.idle()
        hs = rx.expect("small", BytesSink(1000))
        ss = tx.send("small", BytesSource(b"s" * 1000), token=hs.token)
        await asyncio.sleep(0)
        t = ss._transfer
        assert t.pending_chunks == 1  # queued, not written by send()
        await asyncio.gather(sb.wait(30), ss.wait(30), hb.wait(30), hs.wait(30))
        await tx.close()
        await rx.close()

    arun(main(), 60)


def test_many_small_transfers_at_once_all_land() -> None:
    async def main() -> None:
        rx, tx = await _pair(streams=3)
        datas = [os.urandom(1 + 997 * i) for i in range(300)]
        sinks = [OnceSink(len(d)) for d in datas]
        hs = [rx.expect(f"r{i}", s) for i, s in enumerate(sinks)]
        ss = [
            tx.send(f"r{i}", BytesSource(d), token=h.token)
            for i, (d, h) in enumerate(zip(datas, hs, strict=True))
        ]
        await asyncio.gather(*(s.wait(30) for s in ss), *(h.wait(30) for h in hs))
        assert all(bytes(s.data) == d for s, d in zip(sinks, datas, strict=True))
        assert {s.stats.streams for s in ss} == {1}
        # spread over the connections, not all on the first
        assert len({id(s._transfer.tids[0][0]) for s in ss}) == 3
        await tx.close()
        await rx.close()

    arun(main(), 60)


# ---- checksums in the copy: one read of each chunk on each side ------------------------------
class _OnePassSource(BytesSource):
    """Gives each chunk with its checksum from one pass (as the pack core
    does for a KV source); records the calls.  Lends no view, so the
    transport must use ``read_checksummed``."""

    view = None  # type: ignore[assignment]
    read_on_loop = True

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.calls = 0

    def read_checksummed(self, offset: int, n: int) -> tuple[memoryview, int]:
        import xxhash

        self.calls += 1
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return memoryview(buf), xxhash.xxh3_64_intdigest(buf)


class _OnePassSink(OnceSink):
    """Checks each chunk in the pass that writes it; records the checks."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.checked = 0
        self.mismatches = 0

    def write_checksummed(self, offset: int, data: memoryview, checksum: int) -> None:
        import xxhash

        from kvbridge.errors import ChecksumError

        self.checked += 1
        if xxhash.xxh3_64_intdigest(data) != checksum:
            self.mismatches += 1
            raise ChecksumError("chunk checksum mismatch")
        np.frombuffer(self.data, np.uint8)[offset : offset + len(data)] = np.frombuffer(
            data, np.uint8
        )


@pytest.mark.parametrize("size", [3000, 3 << 20])
def test_checksums_in_the_copy_on_both_sides(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A raw chunk is read once on each side: the sender takes the source's
    checksum from the pass that produced the bytes and hashes nothing
    itself; the receiver hashes nothing as the bytes arrive and the sink
    checks them as it writes them."""
    from kvbridge.wire import chunk, codec

    hashed: list[int] = []
    real = chunk.checksum
    monkeypatch.setattr(chunk, "checksum", lambda d: hashed.append(len(d)) or real(d))
    made: list[int] = []

    class Hasher:
        def __init__(self) -> None:
            made.append(1)

        def update(self, b: Any) -> None:
            pass

        def intdigest(self) -> int:
            return 0

    monkeypatch.setattr(
        codec, "xxhash", type("X", (), {"xxh3_64": Hasher, "xxh3_64_intdigest": staticmethod(real)})
    )

    async def main() -> None:
        rx, tx = await _pair(streams=2, chunk_size=1 << 20, compression="off")
        data = os.urandom(size)
        src, sink = _OnePassSource(data), _OnePassSink(size)
        h = rx.expect("r", sink)
        await tx.send("r", src, token=h.token).wait(20)
        await h.wait(20)
        assert bytes(sink.data) == data
        chunks = -(-size // (1 << 20))
        assert src.calls == chunks and sink.checked == chunks
        assert hashed == [] and made == []  # no second pass on either side
        await tx.close()
        await rx.close()

    arun(main(), 60)


def test_a_chunk_damaged_on_the_way_fails_its_check_in_the_copy_and_is_sent_again() -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        proxy, tx = await damaged_second_chunk(rx, 512 * KiB)
        data = os.urandom(4 << 20)
        sink = _OnePassSink(len(data))
        h = rx.expect("r", sink)
        st = await tx.send("r", _OnePassSource(data), token=h.token).wait(30)
        await h.wait(5)
        assert bytes(sink.data) == data  # OnceSink: nothing else written twice
        assert proxy.stats.frames_corrupted == 1 and sink.mismatches == 1
        assert st.retries >= 1 and h.stats.bad_chunks == 1
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main(), 60)


def _kv_pair(seed: int = 1, tokens: int = 700) -> tuple[Any, Any, Any, Any, Any]:
    """A random CPU cache, an empty one of another page size and memory
    order, and their shuffled block tables."""
    from kvbridge import pack
    from kvbridge.layout import KVLayout

    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
    dst_lay = lay.replace(page_tokens=64, order="page_first", head_order="HND")
    rng = np.random.default_rng(seed)
    src = pack.PagedKVCache.allocate(lay, 60, fill="random", seed=seed)
    dst = pack.PagedKVCache.allocate(dst_lay, 20)
    src_bt = rng.permutation(60)[: lay.pages_for(tokens)].astype(np.int32)
    dst_bt = rng.permutation(20)[: dst_lay.pages_for(tokens)].astype(np.int32)
    return pack, src, dst, src_bt, dst_bt


def test_kv_source_and_sink_checksum_in_the_pack_cores_copy() -> None:
    """A CPU KVSource gives each slice with its XXH3-64 from the pack's one
    pass; a KVSink checks it in the unpack's pass: a wrong checksum is a
    ChecksumError and unpacking the right bytes there again repairs it."""
    import xxhash

    from kvbridge.errors import ChecksumError
    from kvbridge.transport.tcp import KVSink, KVSource

    pack, src, dst, src_bt, dst_bt = _kv_pair()
    source, sink = KVSource(src, src_bt, 5, 700, None), KVSink(dst, dst_bt, 5, 700, None)
    assert source.read_checksummed and sink.write_checksummed
    want = bytes(np.asarray(pack.pack(src, src_bt, 5, 700)))
    for off, n in [(0, source.nbytes), (3, 65_541), (source.nbytes - 9, 9), (11, 0)]:
        data, ck = source.read_checksummed(off, n)
        assert bytes(data) == want[off : off + n] and ck == xxhash.xxh3_64_intdigest(data)
    data, ck = source.read_checksummed(4096, 100_000)
    with pytest.raises(ChecksumError):
        sink.write_checksummed(4096, data, ck ^ 1)
    sink.write_checksummed(0, memoryview(want), xxhash.xxh3_64_intdigest(want))
    assert bytes(np.asarray(pack.pack(dst, dst_bt, 5, 700))) == want
    with pytest.raises(ChecksumError):  # the slice is damaged again, then repaired
        sink.write_checksummed(4096, memoryview(bytes(100_000)), ck)
    sink.write_checksummed(4096, data, ck)
    assert bytes(np.asarray(pack.pack(dst, dst_bt, 5, 700))) == want


@pytest.mark.parametrize("chunk", [64 * KiB, 1 << 20])
def test_kv_pages_cross_the_transport_read_once_on_each_side(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV pages through the transport with their checksums in the pack
    core's copies: neither side hashes a chunk in a pass of its own (the
    sender takes the pack's XXH3-64, the receiver leaves the check to the
    unpack), and the destination pages end up equal to the source's."""
    from kvbridge.transport.tcp import KVSink, KVSource
    from kvbridge.wire import chunk as chunk_mod
    from kvbridge.wire import codec

    hashed: list[int] = []
    real = chunk_mod.checksum
    monkeypatch.setattr(chunk_mod, "checksum", lambda d: hashed.append(len(d)) or real(d))
    made: list[int] = []

    class Hasher:
        def __init__(self) -> None:
            made.append(1)

        def update(self, b: Any) -> None:
            pass

        def intdigest(self) -> int:
            return 0

    monkeypatch.setattr(
        codec, "xxhash", type("X", (), {"xxh3_64": Hasher, "xxh3_64_intdigest": staticmethod(real)})
    )
    pack, src, dst, src_bt, dst_bt = _kv_pair(seed=2)

    async def main() -> None:
        rx, tx = await _pair(streams=2, chunk_size=chunk, compression="off")
        source, sink = KVSource(src, src_bt, 5, 700, None), KVSink(dst, dst_bt, 5, 700, None)
        h = rx.expect("kv", sink)
        st = await tx.send("kv", source, token=h.token).wait(20)
        await h.wait(20)
        assert st.bytes == source.nbytes and st.chunks == -(-source.nbytes // chunk)
        assert hashed == [] and made == []  # no second pass on either side
        want = bytes(np.asarray(pack.pack(src, src_bt, 5, 700)))
        assert bytes(np.asarray(pack.pack(dst, dst_bt, 5, 700))) == want
        await tx.close()
        await rx.close()

    arun(main(), 60)


def test_a_damaged_kv_chunk_fails_the_unpacks_check_and_its_resend_repairs_the_pages() -> None:
    from kvbridge.transport.tcp import KVSink, KVSource

    pack, src, dst, src_bt, dst_bt = _kv_pair(seed=3)

    async def main() -> None:
        rx = await TcpReceiver().start()
        proxy, tx = await damaged_second_chunk(rx, 128 * KiB)
        sink = KVSink(dst, dst_bt, 5, 700, None)
        h = rx.expect("kv", sink)
        st = await tx.send("kv", KVSource(src, src_bt, 5, 700, None), token=h.token).wait(30)
        await h.wait(5)
        assert proxy.stats.frames_corrupted == 1
        assert st.retries >= 1 and h.stats.bad_chunks == 1
        want = bytes(np.asarray(pack.pack(src, src_bt, 5, 700)))
        assert bytes(np.asarray(pack.pack(dst, dst_bt, 5, 700))) == want
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main(), 60)


def test_a_layerwise_source_waits_for_its_layers_in_the_one_pass() -> None:
    """LayerwiseSource keeps the checksum in the copy, and its one pass
    still waits for the layers the slice touches."""
    import threading as th

    from kvbridge.bridge.layerwise import LayerwiseSource
    from kvbridge.errors import TransferTimeout

    pack, src, _, src_bt, _ = _kv_pair(seed=4)
    source = LayerwiseSource(src, src_bt, 5, 700, None, layer_timeout=0.2)
    per_layer = source.nbytes // 4
    with pytest.raises(TransferTimeout):
        source.read_checksummed(0, 10)
    source.mark_ready(1)
    data, _ = source.read_checksummed(0, per_layer)  # layer 0 only: no wait
    late = th.Timer(0.05, source.mark_ready, (3,))
    late.start()
    data, _ = source.read_checksummed(per_layer, 2 * per_layer)  # waits for layer 2
    late.join()
    want = bytes(np.asarray(pack.pack(src, src_bt, 5, 700)))
    assert bytes(data) == want[per_layer : 3 * per_layer]


def test_finished_transfers_do_not_count_against_the_open_transfer_limit() -> None:
    """A finished transfer lingers on its connection (a late OPEN still
    learns its outcome) but is not open: a sender may run many more small
    transfers over one connection within the linger than the receiver's
    limit on open transfers per connection."""
    from kvbridge.transport.tcp import ReceiverLimits

    async def main() -> None:
        rx = await TcpReceiver(limits=ReceiverLimits(max_transfers_per_connection=4)).start()
        tx = TcpSender("127.0.0.1", rx.port, streams=1, compression="off")
        data = os.urandom(4 * KiB)
        for i in range(12):
            sink = BytesSink(len(data))
            h = rx.expect(f"r{i}", sink)
            await tx.send(f"r{i}", BytesSource(data), token=h.token).wait(10)
            await h.wait(10)
            assert bytes(sink.data) == data
        await tx.close()
        await rx.close()

    arun(main(), 60)
