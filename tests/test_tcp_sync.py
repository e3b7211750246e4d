"""A multi-stream round trip, a cancelled receive, and CONTROL frames end to
end over real sockets."""

from __future__ import annotations

import asyncio
import os

import pytest
from tcp_support import arun

from kvbridge.errors import Cancelled, TransferAborted
from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge.transport.tcp.conn import FrameConnection
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource


def test_round_trip_over_two_streams_and_a_cancelled_receive() -> None:
    """A 2 MB transfer over two connections in 256 KiB chunks lands byte for
    byte; a receive cancelled before its sender starts fails the receiver
    with Cancelled and the later send with TransferAborted."""

    async def main() -> None:
        data = os.urandom(2_000_000)
        rx = await TcpReceiver().start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2, chunk_size=1 << 18)
        try:
            sink = BytesSink(len(data))
            h = rx.expect("r", sink, timeout=20)
            s = tx.send("r", BytesSource(data), token=h.token, timeout=20)
            stats = await s.wait(20)
            assert await h.wait(20) == len(data) and bytes(sink.data) == data
            assert stats.bytes == len(data) and s.progress == 1.0 and h.done()
            h2 = rx.expect("c", BytesSink(10))
            h2.cancel()
            with pytest.raises(Cancelled):
                await h2.wait(5)
            with pytest.raises(TransferAborted):
                await tx.send("c", BytesSource(b"x" * 10), token=h2.token).wait(5)
        finally:
            await tx.close()
            await rx.close()

    arun(main())


def test_control_round_trip_between_sender_and_receiver() -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        rx.on_control(0x60, lambda c, t, p: c.send_control(0x61, b"have:" + p))
        tx = TcpSender("127.0.0.1", rx.port, streams=1)

        def answer(conn: FrameConnection, typ: int, payload: bytes) -> None:
            got.set_result(payload)

        tx.on_control(0x61, answer)
        await tx.connect()
        tx.send_control(0x60, b"prefix-hash")
        assert await asyncio.wait_for(got, 5) == b"have:prefix-hash"
        await tx.close()
        await rx.close()

    arun(main())
