"""Faults that once lost data or hung, over real sockets (issue 10 items 1-3):

* a repeated or resumed transfer with another chunk size completes, sending
  only what the receiver lacks (its bookkeeping is byte ranges);
* a DATA frame damaged in its header (type, transfer id, seq, offset,
  lengths, checksum) or silently lost is sent again after a bounded time, and
  every wait of the transport has a finite default deadline;
* ``reconnect_timeout`` counts from the moment the transfer last had a
  usable connection, not from the first loss.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from tcp_support import OnceSink, arun

from kvbridge.errors import InvalidArgument, KVBridgeError
from kvbridge.transport.handle import DEFAULT_TRANSFER_TIMEOUT, transfer_timeout
from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource
from kvbridge_bench.sim.emulator import CorruptFrame, DropAtAccept, FaultProxy, Stall

KiB, MiB = 1024, 1 << 20
HERE = Path(__file__).resolve().parent


# ---- item 1: the receiver's bookkeeping does not depend on the sender's chunking ----------
def test_a_ticket_sent_again_with_another_chunk_size_completes_at_once() -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        data = os.urandom(3 * MiB + 5)
        sink = OnceSink(len(data))
        h = rx.expect("r", sink)
        tx1 = TcpSender("127.0.0.1", rx.port, chunk_size=256 * KiB, streams=2)
        await tx1.send("r", BytesSource(data), token=h.token).wait(20)
        await tx1.close()
        # a retry from another sender whose fitted chunk size differs
        tx2 = TcpSender("127.0.0.1", rx.port, chunk_size=384 * KiB, streams=3)
        st = await tx2.send("r", BytesSource(data), token=h.token).wait(20)
        # only the first chunk on each connection left before RESUME + COMPLETE
        # said that every byte is held (it goes with the OPEN); the receiver
        # dropped those (OnceSink: no byte written twice)
        assert st.chunks <= 3 and st.wire_bytes <= 3 * 384 * KiB
        assert bytes(sink.data) == data
        await tx2.close()
        await rx.close()

    arun(main())


def test_a_sender_killed_mid_transfer_is_resumed_by_one_with_another_chunk_size(
    tmp_path: Path,
) -> None:
    """A sender process is killed (SIGKILL) mid-transfer (its connections
    stall after 1.5 MiB each, so it is surely mid-way); a new sender with
    another chunk size completes the transfer and sends the bytes the
    receiver did not hold, plus at most the one chunk per connection that
    left with its OPEN before RESUME told what is held; no byte is written
    twice."""
    size = 9 * MiB + 123
    data = os.urandom(size)
    path = tmp_path / "payload.bin"
    path.write_bytes(data)

    async def main() -> None:
        rx = await TcpReceiver().start()
        sink = OnceSink(size)
        h = rx.expect("r", sink, timeout=60)
        proxy = FaultProxy(("127.0.0.1", rx.port), [Stall(after=3 * MiB // 2)])
        await proxy.start()
        host, port = proxy.listen_addr
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "tcp_send_file.py"), host, str(port), h.token.hex(),
            str(path), str(320 * KiB), "2", stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            t0 = time.monotonic()
            while proxy.stats.stalls < 2 or rx.inflight_bytes:
                assert time.monotonic() - t0 < 30, "the first sender did not get going"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
        finally:
            proc.kill()
            await proc.wait()
        await proxy.close()
        held = h.received_bytes
        assert MiB <= held < size
        tx = TcpSender("127.0.0.1", rx.port, chunk_size=384 * KiB, streams=3, compression="off")
        st = await tx.send("r", BytesSource(data), token=h.token).wait(30)
        await h.wait(5)
        assert bytes(sink.data) == data
        # what was missing crossed the wire, and at most the 3 early chunks more
        assert size - held <= st.wire_bytes <= size - held + 3 * 384 * KiB
        await tx.close()
        await rx.close()

    arun(main(), 90)


# ---- item 2: a damaged or lost DATA frame is sent again; every wait is bounded ------------
@pytest.mark.parametrize(
    ("field", "bit"),
    [
        ("type", 6),  # DATA (0x12) becomes CONTROL 0x52: dropped without a word
        ("type", 0),  # becomes ACK: a sender may not send it
        ("id", 1),  # another transfer id
        ("seq", 0),
        ("offset", 20),
        ("raw_length", 3),
        ("wire_length", 2),
        ("length", 2),  # the frame length: the framing after it is lost
        ("length", 30),  # a length over the limit
        ("checksum", 9),
        ("body", None),
    ],
)
def test_a_data_frame_damaged_in_its_header_is_sent_again(field: str, bit: int | None) -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        proxy = FaultProxy(
            ("127.0.0.1", rx.port), [CorruptFrame(field, frames=[3], bit=bit, conns=[0])]
        )
        await proxy.start()
        host, port = proxy.listen_addr
        tx = TcpSender(host, port, streams=1, chunk_size=64 * KiB, ack_timeout=0.3)
        data = os.urandom(40 * 64 * KiB)
        sink = OnceSink(len(data))
        h = rx.expect("r", sink)
        t0 = time.monotonic()
        st = await tx.send("r", BytesSource(data), token=h.token).wait(20)  # default deadline
        await h.wait(5)
        assert bytes(sink.data) == data
        assert proxy.stats.frames_corrupted == 1
        assert st.retries >= 1 and time.monotonic() - t0 < 10
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main())


def test_every_transport_wait_has_a_finite_default_deadline() -> None:
    assert transfer_timeout(None) == DEFAULT_TRANSFER_TIMEOUT == 60.0
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument):
            transfer_timeout(bad)

    async def main() -> None:
        rx = await TcpReceiver().start()
        tx = TcpSender("127.0.0.1", rx.port, streams=1)
        loop = asyncio.get_running_loop()
        h = rx.expect("r", BytesSink(10))
        s = tx.send("r", BytesSource(b"x" * 10), token=bytes(16))  # a token never issued
        assert h._transfer.deadline - loop.time() == pytest.approx(60.0, abs=1)
        assert s._transfer.deadline - loop.time() == pytest.approx(60.0, abs=1)
        with pytest.raises(KVBridgeError):
            await s  # refused: the wait ends
        for kw in ({"timeout": float("inf")}, {"timeout": 0}):
            with pytest.raises(InvalidArgument):
                rx.expect("x", BytesSink(1), **kw)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument):
                tx.send("x", BytesSource(b"x"), token=bytes(16), **kw)  # type: ignore[arg-type]
        h.cancel()
        await tx.close()
        await rx.close()

    arun(main())


# ---- item 3: reconnect_timeout counts from the last usable connection ----------------------
def test_reconnect_timeout_counts_from_the_last_lost_connection() -> None:
    """4 streams, reconnect_timeout 4 s: one connection lost at t=0, the other
    three at t=2, no connection possible until t=4.5.  The deadline is t=6
    (the transfer had no connection from t=2): it completes.  Counted from
    the first loss it would have failed at t=4."""
    gate = threading.Event()

    class GatedSink(BytesSink):
        view = None  # type: ignore[assignment]

        def write(self, offset: int, chunk: memoryview) -> None:
            if offset >= MiB:
                gate.wait(30)
            super().write(offset, chunk)

    async def main() -> None:
        rx = await TcpReceiver().start()
        proxy = FaultProxy(("127.0.0.1", rx.port))
        await proxy.start()
        host, port = proxy.listen_addr
        tx = TcpSender(host, port, streams=4, chunk_size=320 * KiB, reconnect_timeout=4.0)
        await tx.connect()
        data = os.urandom(8 * MiB)
        sink = GatedSink(len(data))
        h = rx.expect("r", sink)
        s = tx.send("r", BytesSource(data), token=h.token)
        while h.received_bytes < MiB // 2:
            await asyncio.sleep(0.01)
        proxy.set_faults([DropAtAccept()])  # no new connection gets through
        first = proxy.live_connections
        assert len(first) == 4
        proxy.reset(first[0])
        await asyncio.sleep(2.0)
        assert not s.done()
        for i in first[1:]:
            proxy.reset(i)
        await asyncio.sleep(2.5)
        assert not s.done(), s._fut.exception() if s.done() else None
        proxy.set_faults([])  # t = 4.5: connections get through again
        gate.set()
        await s.wait(20)
        await h.wait(5)
        assert bytes(sink.data) == data
        assert tx.stats["reconnects"] >= 1
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main(), 60)
