"""End-to-end transfers over loopback: integrity, striping, compression,
scheduling, memory bounds, completion semantics, cancellation, deadlines."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from tcp_support import OnceSink, arun

from kvbridge.errors import (
    AuthenticationError,
    Cancelled,
    IncompatiblePeer,
    InvalidArgument,
    TransferAborted,
    TransferTimeout,
)
from kvbridge.transport.tcp import ReceiverLimits, TcpReceiver, TcpSender
from kvbridge.transport.tcp.compress import CompressionPolicy
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource
from kvbridge.wire.frames import ErrorCode

KiB, MiB = 1024, 1 << 20


def fp16_bytes(n: int, seed: int = 1) -> bytes:
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, n // 2).astype(np.float16).tobytes()


async def pair(**sender_kw: object) -> tuple[TcpReceiver, TcpSender]:
    rx = await TcpReceiver().start()
    kw: dict[str, object] = {"streams": 3, "chunk_size": 256 * KiB}
    kw.update(sender_kw)
    tx = TcpSender("127.0.0.1", rx.port, **kw)  # type: ignore[arg-type]
    return rx, tx


@pytest.mark.parametrize("size", [0, 1, 7, 256 * KiB, 256 * KiB + 1, 3 * MiB + 5])
@pytest.mark.parametrize("streams", [1, 4])
def test_round_trip_sizes(size: int, streams: int) -> None:
    async def main() -> None:
        rx, tx = await pair(streams=streams)
        data = os.urandom(size)
        sink = OnceSink(size)
        h = rx.expect("req", sink, timeout=20)
        sh = tx.send("req", BytesSource(data), token=h.token, timeout=20)
        stats = await sh
        assert await h == size
        assert bytes(sink.data) == data and sink.flushed
        assert stats.bytes == size and sh.progress == 1.0 and h.progress == 1.0
        assert stats.streams <= streams
        if size > 4 * 256 * KiB and streams == 4:
            assert stats.streams > 1  # chunks were striped
        await tx.close()
        await rx.close()

    arun(main())


@pytest.mark.parametrize("mode", ["lz4", "zstd"])
def test_forced_compression_round_trip(mode: str) -> None:
    async def main() -> None:
        rx, tx = await pair()
        data = fp16_bytes(2 * MiB + 6)
        sink = BytesSink(len(data))
        h = rx.expect("c", sink)
        src = BytesSource(data, itemsize=2)
        stats = await tx.send("c", src, token=h.token, compression=mode).wait(20)
        await h.wait(20)
        assert bytes(sink.data) == data
        assert stats.compression["codec"] == mode and stats.compression["shuffle"] == 2
        if mode == "zstd":
            assert stats.wire_bytes < 0.95 * stats.bytes
        await tx.close()
        await rx.close()

    arun(main())


def test_adaptive_compression_decisions() -> None:
    data = memoryview(fp16_bytes(4 * MiB))
    slow = CompressionPolicy("auto", link_Bps=1e6, spare_cores=1)  # 8 Mbit/s: pays
    d = slow.decide(data, 2, 64 * MiB)
    assert d.codec != 0 and d.shuffle == 2 and d.ratio_zstd is not None and d.ratio_zstd < 1
    fast = CompressionPolicy("auto", link_Bps=50e9, spare_cores=1)  # faster than one core
    d = fast.decide(data, 2, 64 * MiB)
    assert d.codec == 0 and "faster" in d.reason
    rnd = CompressionPolicy("auto", link_Bps=1e6, spare_cores=1)  # incompressible
    d = rnd.decide(memoryview(os.urandom(4 * MiB)), 1, 64 * MiB)
    assert d.codec == 0 and "does not pay" in d.reason
    assert CompressionPolicy("auto", link_Bps=1e6).decide(data, 2, MiB).codec == 0  # too small
    unknown = CompressionPolicy("auto")
    assert unknown.decide(data, 2, 64 * MiB).codec == 0
    unknown.observe_goodput(64 * MiB, 64.0)  # 1 MB/s measured
    assert unknown.decide(data, 2, 64 * MiB).codec != 0


def test_small_transfer_finishes_while_large_runs() -> None:
    async def main() -> None:
        rx, tx = await pair(streams=2, chunk_size=128 * KiB)
        big = os.urandom(24 * MiB)
        small = os.urandom(256 * KiB)
        bsink, ssink = BytesSink(len(big)), BytesSink(len(small))
        hb = rx.expect("big", bsink)
        hs = rx.expect("small", ssink)
        sb = tx.send("big", BytesSource(big), token=hb.token)
        while sb.acked_bytes < 2 * MiB:
            await asyncio.sleep(0.001)
        ss = tx.send("small", BytesSource(small), token=hs.token)
        await ss.wait(20)
        assert not sb.done(), "the small transfer waited for the large one"
        assert sb.progress < 1.0
        await sb.wait(30)
        assert bytes(bsink.data) == big and bytes(ssink.data) == small
        await tx.close()
        await rx.close()

    arun(main())


def test_priority_beats_size() -> None:
    from kvbridge.transport.tcp.scheduler import ChunkScheduler

    class T:
        def __init__(self, prio: int, n: int, arrival: int) -> None:
            self.priority, self.arrival, self.n = prio, arrival, n

        @property
        def unsent_bytes(self) -> int:
            return self.n

        def has_pending(self) -> bool:
            return self.n > 0

        def pop_pending(self) -> int:
            self.n -= 1
            return self.n

    async def main() -> None:
        s = ChunkScheduler("srpt")
        big_urgent, small, tiny_late = T(5, 100, 0), T(0, 3, 1), T(0, 2, 2)
        for t in (big_urgent, small, tiny_late):
            s.add(t)
        assert s.pick()[0] is big_urgent  # type: ignore[index]
        big_urgent.priority = 0
        assert s.pick()[0] is tiny_late  # type: ignore[index]
        f = ChunkScheduler("fifo")
        for t in (T(0, 100, 0), T(0, 1, 1)):
            f.add(t)
        assert f.pick()[0].arrival == 0  # type: ignore[index,union-attr]

    arun(main())


def test_200_concurrent_transfers_within_memory_bound() -> None:
    limit = 2 * MiB

    async def main() -> None:
        rx = await TcpReceiver(limits=ReceiverLimits(max_inflight_bytes_per_peer=limit)).start()
        # compressed chunks into sinks that lend no memory: every chunk is
        # decoded and written by a worker thread, so received chunks wait in
        # the write queue and count against the budget (small raw chunks are
        # written at once, as they arrive, and never wait there)
        tx = TcpSender("127.0.0.1", rx.port, streams=4, chunk_size=64 * KiB, compression="zstd")
        peak = 0
        done = False

        async def watch() -> None:
            nonlocal peak
            while not done:
                peak = max(peak, rx.inflight_bytes)
                await asyncio.sleep(0)

        w = asyncio.get_running_loop().create_task(watch())
        datas = [os.urandom(100 * KiB + i * 997) for i in range(200)]
        sinks = [OnceSink(len(d)) for d in datas]
        hs = [rx.expect(f"r{i}", s) for i, s in enumerate(sinks)]
        ss = [
            tx.send(f"r{i}", BytesSource(d), token=h.token)
            for i, (d, h) in enumerate(zip(datas, hs, strict=True))
        ]
        await asyncio.gather(*(s.wait(60) for s in ss), *(h.wait(60) for h in hs))
        done = True
        await w
        assert all(bytes(s.data) == d for s, d in zip(sinks, datas, strict=True))
        # the bound plus what one read can deliver past it (one frame per
        # connection; a zstd frame of random bytes is a few bytes longer)
        assert 0 < peak <= limit + 4 * (64 * KiB + 200)
        assert rx.inflight_bytes == 0 and rx.active_transfers == 0
        await tx.close()
        await rx.close()

    arun(main(), 80)


def test_never_issued_token_is_refused() -> None:
    async def main() -> None:
        rx, tx = await pair()
        real = rx.expect("victim", BytesSink(1000))
        h = tx.send("victim", BytesSource(b"x" * 1000), token=os.urandom(16))
        with pytest.raises(AuthenticationError, match="token"):
            await h.wait(10)
        assert rx.stats["unknown_tokens"] >= 1
        assert not real.done() and real.received_bytes == 0
        real.cancel()
        await tx.close()
        await rx.close()

    arun(main())


def test_open_mismatch_fails_both_sides() -> None:
    async def main() -> None:
        rx, tx = await pair()
        h = rx.expect("req", BytesSink(1000, layout_hash=7))
        sh = tx.send("req", BytesSource(b"x" * 1000, layout_hash=8), token=h.token)
        with pytest.raises(IncompatiblePeer, match="layout hash"):
            await sh.wait(10)
        with pytest.raises(IncompatiblePeer):
            await h.wait(10)
        h2 = rx.expect("req2", BytesSink(10))
        with pytest.raises(IncompatiblePeer, match="request id"):
            await tx.send("other", BytesSource(b"y" * 10), token=h2.token).wait(10)
        await tx.close()
        await rx.close()

    arun(main())


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_cancel_frees_both_ends(side: str) -> None:
    async def main() -> None:
        rx, tx = await pair(streams=2, chunk_size=64 * KiB)
        data = os.urandom(64 * MiB)
        h = rx.expect("big", BytesSink(len(data)))
        sh = tx.send("big", BytesSource(data), token=h.token)
        while sh.acked_bytes < MiB:
            await asyncio.sleep(0.001)
        if side == "sender":
            sh.cancel()
            with pytest.raises(Cancelled):
                await sh.wait(5)
            with pytest.raises(TransferAborted) as ei:
                await h.wait(5)
            assert ei.value.code == ErrorCode.CANCELLED
        else:
            h.cancel()
            with pytest.raises(Cancelled):
                await h.wait(5)
            with pytest.raises(TransferAborted) as ei:
                await sh.wait(5)
            assert ei.value.code == ErrorCode.CANCELLED
        for _ in range(500):
            if rx.inflight_bytes == 0 and not tx._active and rx.active_transfers == 0:
                break
            await asyncio.sleep(0.01)
        assert rx.inflight_bytes == 0 and rx.active_transfers == 0
        assert not tx._active and len(tx.scheduler) == 0
        # the connections survive and carry the next transfer
        h2 = rx.expect("next", BytesSink(5))
        await tx.send("next", BytesSource(b"hello"), token=h2.token).wait(10)
        assert await h2 == 5
        await tx.close()
        await rx.close()

    arun(main())


@pytest.mark.parametrize("connected", [True, False])
def test_a_cancel_right_after_send_reaches_the_receiver(connected: bool) -> None:
    """cancel() before the transfer's OPEN went out (same tick as send, or
    before the sender is even connected) still aborts the receiver's
    expectation at once, not at its own deadline."""

    async def main() -> None:
        rx = await TcpReceiver().start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2)
        if connected:
            await tx.connect()
        h = rx.expect("r", BytesSink(MiB), timeout=30)
        sh = tx.send("r", BytesSource(os.urandom(MiB)), token=h.token)
        sh.cancel()  # no await in between
        with pytest.raises(Cancelled):
            await sh.wait(5)
        with pytest.raises(TransferAborted) as ei:
            await h.wait(5)
        assert ei.value.code == ErrorCode.CANCELLED
        await tx.close()
        await rx.close()

    arun(main())


def test_a_completed_transfer_sent_again_completes_without_bytes() -> None:
    """The same ticket sent again on the same connection: RESUME + COMPLETE,
    and no byte written again.  (A small transfer's chunk leaves with its
    OPEN, before RESUME can say that it is held: the receiver drops it.)"""

    async def main() -> None:
        rx, tx = await pair()
        sink = BytesSink(1000)
        h = rx.expect("r", sink)
        data = os.urandom(1000)
        await tx.send("r", BytesSource(data), token=h.token).wait(10)
        writes = sink.writes
        again = await tx.send("r", BytesSource(data), token=h.token).wait(10)
        assert sink.writes == writes
        assert again.chunks_sent <= 1
        assert h.stats.duplicates == again.chunks_sent
        await tx.close()
        await rx.close()

    arun(main())


def test_deadlines_are_typed() -> None:
    async def main() -> None:
        rx, tx = await pair()
        h = rx.expect("never", BytesSink(10), timeout=0.2)
        with pytest.raises(TransferTimeout, match=r"after 0\.2 s"):
            await h.wait()  # the transfer's own deadline, named as such
        h1 = rx.expect("never-1", BytesSink(10), timeout=0.2)
        with pytest.raises(TransferTimeout, match=r"after 0\.2 s"):
            await h1.wait(5)
        h2 = rx.expect("slow", BytesSink(10))
        with pytest.raises(TransferTimeout):
            await h2.wait(0.05)  # a wait deadline does not end the transfer
        assert not h2.done()
        h2.cancel()
        await tx.close()
        await rx.close()

    arun(main())


def test_bad_arguments() -> None:
    async def main() -> None:
        rx, tx = await pair()
        with pytest.raises(InvalidArgument):
            tx.send("x", BytesSource(b"a"), token=b"short")
        with pytest.raises(InvalidArgument):
            tx.send("x", BytesSource(b"a"), token=bytes(16), priority=300)
        with pytest.raises(InvalidArgument):
            rx.expect("x", object())  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            TcpSender("127.0.0.1", 1, streams=0)
        await tx.close()
        await rx.close()

    arun(main())


def test_chunk_size_fits_a_receiver_with_small_frames() -> None:
    async def main() -> None:
        rx = await TcpReceiver(limits=ReceiverLimits(max_frame=64 * KiB)).start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2, chunk_size=4 * MiB)
        data = os.urandom(MiB + 3)
        sink = OnceSink(len(data))
        h = rx.expect("r", sink)
        stats = await tx.send("r", BytesSource(data), token=h.token).wait(20)
        await h.wait(20)
        assert bytes(sink.data) == data
        assert max(b - a for a, b in sink.spans) <= 64 * KiB - 44
        assert stats.chunks_sent == len(sink.spans)
        await tx.close()
        await rx.close()

    arun(main())


def test_sender_memory_bounded_when_the_receiver_is_slow() -> None:
    import threading

    gate = threading.Event()

    class StalledSink(BytesSink):
        view = None  # type: ignore[assignment]  # every chunk through the stalled write

        def write(self, offset: int, data: memoryview) -> None:
            gate.wait(20)  # the receiver stops until the sender has had to buffer
            super().write(offset, data)

    async def main() -> None:
        rx = await TcpReceiver(limits=ReceiverLimits(max_inflight_bytes_per_peer=MiB)).start()
        chunk = MiB
        tx = TcpSender("127.0.0.1", rx.port, streams=2, chunk_size=chunk)
        # more than the kernel's socket buffers on both ends can hold
        data = memoryview(bytearray(96 * MiB))
        data[:: 4 * KiB] = os.urandom(len(data) // (4 * KiB))
        sink = StalledSink(len(data))
        h = rx.expect("slow", sink)
        s = tx.send("slow", BytesSource(data), token=h.token)
        peak = 0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while not s.done():
            peak = max(peak, sum(link.conn.write_buffer_size for link in tx._links))
            if (peak and loop.time() - t0 > 0.3) or loop.time() - t0 > 5:
                gate.set()
            await asyncio.sleep(0.001)
        await s.wait(30)
        assert bytes(sink.data) == data
        high = max(MiB, chunk)  # the write buffer's high-water mark per stream
        assert 0 < peak <= 2 * (high + chunk + 100)
        await tx.close()
        await rx.close()

    arun(main(), 60)


@pytest.mark.parametrize(
    "chunk_size, link_Bps, streams, expect",
    [
        (None, None, 4, 4 * MiB),  # link unknown: the largest
        (None, 125e6, 4, 768 * KiB),  # 1 Gbit/s over 4 streams: ~30 ms of one stream
        (None, 125e6, 1, 3 * MiB + 512 * KiB),
        (None, 10e9, 4, 4 * MiB),  # fast link: capped
        (None, 1e6, 4, 256 * KiB),  # slow link: floored
        (MiB, 125e6, 4, MiB),  # configured: fixed
    ],
)
def test_chunk_size_fitted_to_the_link(
    chunk_size: int | None, link_Bps: float | None, streams: int, expect: int
) -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        policy = CompressionPolicy("off", link_Bps=link_Bps)
        tx = TcpSender(
            "127.0.0.1", rx.port, streams=streams, chunk_size=chunk_size, compression=policy
        )
        data = os.urandom(5 * MiB + 1)
        sink = BytesSink(len(data))
        h = rx.expect("r", sink)
        stats = await tx.send("r", BytesSource(data), token=h.token).wait(20)
        await h.wait(20)
        assert bytes(sink.data) == data
        assert stats.chunk_size == expect
        assert h.stats.chunks == stats.chunks_sent == -(-len(data) // expect)
        await tx.close()
        await rx.close()

    arun(main())
