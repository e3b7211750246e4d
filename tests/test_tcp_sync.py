"""The blocking wrappers, and CONTROL frames end to end over real sockets."""

from __future__ import annotations

import asyncio
import os

import pytest
from tcp_support import arun

from kvbridge.errors import Cancelled, TransferAborted
from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge.transport.tcp.conn import FrameConnection
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource
from kvbridge.transport.tcp.sync import SyncReceiver, SyncSender


def test_sync_round_trip_and_cancel() -> None:
    data = os.urandom(2_000_000)
    with (
        SyncReceiver() as rx,
        SyncSender("127.0.0.1", rx.port, streams=2, chunk_size=1 << 18) as tx,
    ):
        sink = BytesSink(len(data))
        h = rx.expect("r", sink, timeout=20)
        s = tx.send("r", BytesSource(data), token=h.token, timeout=20)
        stats = s.wait(20)
        assert h.wait(20) == len(data) and bytes(sink.data) == data
        assert stats.bytes == len(data) and s.progress == 1.0 and h.done()
        h2 = rx.expect("c", BytesSink(10))
        h2.cancel()
        with pytest.raises(Cancelled):
            h2.wait(5)
        with pytest.raises(TransferAborted):
            tx.send("c", BytesSource(b"x" * 10), token=h2.token).wait(5)


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
