"""The receiver's protocol logic driven byte by byte through a mock transport
(no sockets): handshake, OPEN / RESUME, DATA, duplicates, NACK, hostile frames."""

from __future__ import annotations

import asyncio
import os

import zstandard
from tcp_support import arun

from kvbridge.testing.mock_stream import MockTransport
from kvbridge.transport.tcp import TcpReceiver
from kvbridge.transport.tcp.conn import FrameConnection
from kvbridge.transport.tcp.kvio import BytesSink
from kvbridge.wire import ClientHandshake, encode_frame
from kvbridge.wire.chunk import checksum
from kvbridge.wire.frames import (
    ALL_CAPABILITIES,
    CODEC_CAPABILITIES,
    Abort,
    Ack,
    ChunkCodec,
    Complete,
    Control,
    Data,
    Error,
    ErrorCode,
    HelloAck,
    Nack,
    Open,
    Ready,
    Resume,
)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


async def handshaken(
    rx: TcpReceiver, psk: bytes | None = None, *, ranged: bool = False
) -> MockTransport:
    """A mock sender connection; ``ranged`` announces RANGES (DATA frames then
    carry the header check: ``data_frame(..., checked=True)``)."""
    conn = FrameConnection(on_made=rx._on_made)
    t = MockTransport(conn)
    caps = ALL_CAPABILITIES if ranged else CODEC_CAPABILITIES
    hs = ClientHandshake("mock-sender", rx.compat_hash, psk=psk, capabilities=caps)
    t.feed(encode_frame(hs.hello()))
    await settle()
    (ack,) = t.read_messages()
    assert isinstance(ack, HelloAck)
    t.feed(encode_frame(hs.on_hello_ack(ack)))
    await settle()
    assert t.read_messages() == [Ready()]
    return t


def data_frame(
    tid: int, seq: int, off: int, body: bytes, ck: int | None = None, *, checked: bool = False
) -> bytes:
    c = checksum(body) if ck is None else ck
    return encode_frame(Data(tid, seq, off, len(body), 0, 0, c, body, head_check=checked))


def test_open_data_duplicate_nack_complete() -> None:
    async def main() -> None:
        rx = TcpReceiver(psk=b"k" * 16, keepalive_interval=60)
        payload = os.urandom(25)
        sink = BytesSink(25)
        h = rx.expect("req", sink)
        t = await handshaken(rx, psk=b"k" * 16)
        t.feed(encode_frame(Open(5, os.urandom(16), 0, 25, 10, 0, 0, 0, 0, 7, 0, "req")))
        t.feed(encode_frame(Open(6, h.token, 0, 25, 10, 0, 0, 0, 0, 7, 0, "req")))
        await settle()
        a, r = t.read_messages()
        assert isinstance(a, Abort) and a.transfer_id == 5 and a.code == ErrorCode.UNKNOWN_TOKEN
        assert r == Resume(6, ())
        t.feed(data_frame(6, 1, 10, payload[10:20]))
        t.feed(data_frame(6, 0, 0, payload[:10], ck=123))  # damaged
        await settle()
        msgs = t.read_messages()
        assert Ack(6, ((10, 10),)) in msgs
        assert Nack(6, 0, 10, ErrorCode.CHECKSUM) in msgs
        t.feed(data_frame(6, 1, 10, payload[10:20]))  # duplicate: acked again, not rewritten
        t.feed(data_frame(6, 0, 0, payload[:10]))
        t.feed(data_frame(6, 2, 20, payload[20:]))
        await settle()
        msgs = t.read_messages()
        assert msgs[-1] == Complete(6, 25)
        assert await h == 25 and bytes(sink.data) == payload and sink.writes == 3
        assert h.stats.duplicates == 1 and h.stats.bad_chunks == 1
        t.close()
        await rx.close()

    arun(main())


def test_off_grid_data_is_a_protocol_error() -> None:
    async def main() -> None:
        rx = TcpReceiver(keepalive_interval=60)
        h = rx.expect("req", BytesSink(25))
        t = await handshaken(rx)
        t.feed(encode_frame(Open(1, h.token, 0, 25, 10, 0, 0, 0, 0, 7, 0, "req")))
        t.feed(data_frame(1, 0, 3, b"x" * 10))
        await settle()
        msgs = t.read_messages()
        assert isinstance(msgs[-1], Error) and msgs[-1].code == ErrorCode.PROTOCOL_ERROR
        assert t.closed and h.received_bytes == 0
        h.cancel()
        await rx.close()

    arun(main())


def test_control_frames_reach_their_handler() -> None:
    async def main() -> None:
        rx = TcpReceiver(keepalive_interval=60)
        seen: list[tuple[int, bytes]] = []

        def on_handoff(conn: FrameConnection, typ: int, payload: bytes) -> None:
            seen.append((typ, payload))
            conn.send_control(typ + 1, payload[::-1])

        rx.on_control(0x41, on_handoff)
        t = await handshaken(rx)
        t.feed(encode_frame(Control(0x41, 0, b"tokens:1,2,3")))
        t.feed(encode_frame(Control(0x66, 0, b"no handler: dropped")))
        await settle()
        assert seen == [(0x41, b"tokens:1,2,3")]
        assert t.read_messages() == [Control(0x42, 0, b"3,2,1:snekot")]
        assert not t.closed
        t.close()
        await rx.close()

    arun(main())


def test_a_body_that_decodes_to_the_wrong_length_is_nacked_decompress() -> None:
    """Checksum right, zstd body one byte short: NACK DECOMPRESS (16); garbage
    that does not decompress at all: DECOMPRESS too; a wrong checksum: CHECKSUM."""

    async def main() -> None:
        rx = TcpReceiver(keepalive_interval=60)
        payload = os.urandom(30)
        sink = BytesSink(30)
        h = rx.expect("req", sink)
        t = await handshaken(rx)
        t.feed(encode_frame(Open(1, h.token, 0, 30, 10, 0, 0, 0, 0, 7, 0, "req")))
        short = zstandard.ZstdCompressor(level=1).compress(payload[:9])
        garbage = b"\x28\xb5\x2f\xfd" + b"\x00" * 12
        for seq, body, ck in ((0, short, None), (1, garbage, None), (2, short, 1)):
            raw_len = 10
            c = checksum(body) if ck is None else ck
            t.feed(encode_frame(Data(1, seq, seq * 10, raw_len, ChunkCodec.ZSTD, 0, c, body)))
        await settle()
        msgs = t.read_messages()
        assert Resume(1, ()) in msgs
        assert Nack(1, 0, 10, ErrorCode.DECOMPRESS) in msgs
        assert Nack(1, 10, 10, ErrorCode.DECOMPRESS) in msgs
        assert Nack(1, 20, 10, ErrorCode.CHECKSUM) in msgs
        assert h.received_bytes == 0 and not t.closed
        h.cancel()
        t.close()
        await rx.close()

    arun(main())


def test_later_opens_must_match_the_first_and_attach_once() -> None:
    """A second OPEN of a token on the same connection, or one on another
    connection with other ranges, gets ABORT TRANSFER_MISMATCH; the transfer
    itself carries on."""

    async def main() -> None:
        rx = TcpReceiver(keepalive_interval=60)
        payload = os.urandom(20)
        sink = BytesSink(20)  # plain bytes: the expectation names no ranges
        h = rx.expect("req", sink)
        a = await handshaken(rx)
        b = await handshaken(rx)
        a.feed(encode_frame(Open(1, h.token, 0, 20, 10, 0, 5, 0, 2, 7, 0, "req")))
        a.feed(encode_frame(Open(2, h.token, 0, 20, 10, 0, 5, 0, 2, 7, 0, "req")))
        b.feed(encode_frame(Open(1, h.token, 0, 20, 10, 0, 6, 0, 2, 7, 0, "req")))
        await settle()
        ma, mb = a.read_messages(), b.read_messages()
        assert ma[0] == Resume(1, ())
        assert isinstance(ma[1], Abort) and ma[1].transfer_id == 2
        assert ma[1].code == ErrorCode.TRANSFER_MISMATCH and "already open" in ma[1].reason
        assert len(mb) == 1 and isinstance(mb[0], Abort)
        assert mb[0].code == ErrorCode.TRANSFER_MISMATCH and "first OPEN" in mb[0].reason
        a.feed(data_frame(1, 0, 0, payload[:10]))
        a.feed(data_frame(1, 1, 10, payload[10:]))
        await settle()
        assert a.read_messages()[-1] == Complete(1, 20)
        assert await h == 20 and bytes(sink.data) == payload
        a.close()
        b.close()
        await rx.close()

    arun(main())


def test_an_unknown_codec_closes_the_connection_not_the_transfer() -> None:
    async def main() -> None:
        rx = TcpReceiver(keepalive_interval=60)
        payload = os.urandom(10)
        sink = BytesSink(10)
        h = rx.expect("req", sink)
        a = await handshaken(rx)
        a.feed(encode_frame(Open(1, h.token, 0, 10, 10, 0, 0, 0, 0, 7, 0, "req")))
        a.feed(encode_frame(Data(1, 0, 0, 10, 9, 0, checksum(payload), payload)))  # codec 9
        await settle()
        msgs = a.read_messages()
        assert isinstance(msgs[-1], Error) and msgs[-1].code == ErrorCode.PROTOCOL_ERROR
        assert a.closed and not h.done()  # the transfer lives on
        b = await handshaken(rx)
        b.feed(encode_frame(Open(1, h.token, 0, 10, 10, 0, 0, 0, 0, 7, 0, "req")))
        b.feed(data_frame(1, 0, 0, payload))
        await settle()
        assert b.read_messages()[-1] == Complete(1, 10)
        assert await h == 10 and bytes(sink.data) == payload
        b.close()
        await rx.close()

    arun(main())


def test_the_open_transfer_limit_counts_open_transfers_not_lingering_ones() -> None:
    """max_transfers_per_connection refuses an OPEN beyond the limit with
    RESOURCE_LIMIT while that many are open; a finished transfer lingers
    (a late OPEN learns its outcome) but no longer counts."""
    from kvbridge.transport.tcp import ReceiverLimits

    async def main() -> None:
        rx = TcpReceiver(
            keepalive_interval=60, limits=ReceiverLimits(max_transfers_per_connection=2)
        )
        hs = [rx.expect(f"r{i}", BytesSink(10)) for i in range(4)]
        t = await handshaken(rx)

        def open_(tid: int, i: int) -> bytes:
            return encode_frame(Open(tid, hs[i].token, 0, 10, 10, 0, 0, 0, 0, 7, 0, f"r{i}"))

        t.feed(open_(1, 0) + open_(2, 1) + open_(3, 2))
        await settle()
        r1, r2, a3 = t.read_messages()
        assert r1 == Resume(1, ()) and r2 == Resume(2, ())
        assert isinstance(a3, Abort) and a3.code == ErrorCode.RESOURCE_LIMIT
        t.feed(data_frame(1, 0, 0, b"0123456789"))
        await settle()
        assert t.read_messages() == [Ack(1, ((0, 10),)), Complete(1, 10)]
        assert await hs[0] == 10
        t.feed(open_(4, 0))  # a late OPEN of the finished transfer learns its outcome
        t.feed(open_(5, 3))  # 1 and 4 linger, 2 is open: accepted
        await settle()
        assert t.read_messages() == [Resume(4, ((0, 10),)), Complete(4, 10), Resume(5, ())]
        t.feed(open_(6, 2))  # 2 and 5 are open
        await settle()
        (a6,) = t.read_messages()
        assert isinstance(a6, Abort) and a6.code == ErrorCode.RESOURCE_LIMIT
        t.close()
        await rx.close()

    arun(main())
