"""Faults: connection resets at random points (resume), damaged chunks
(resend), silent peers (keepalive), hostile frames, resource limits."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tcp_support import FaultProxy, OnceSink, PlacedSink, arun

from kvbridge.errors import Cancelled, InvalidArgument, PeerGone, ResourceLimit, TransferAborted
from kvbridge.transport.tcp import ReceiverLimits, TcpReceiver
from kvbridge.transport.tcp.conn import FrameConnection
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource
from kvbridge.transport.tcp.receiver import ExpectHandle
from kvbridge.transport.tcp.sender import TcpSender
from kvbridge.wire import ClientHandshake, FrameDecoder, encode_frame
from kvbridge.wire.chunk import checksum
from kvbridge.wire.frames import (
    CODEC_CAPABILITIES,
    Ack,
    Data,
    Error,
    ErrorCode,
    Nack,
    Open,
    Ping,
    Ready,
)
from kvbridge.wire.txtransfer import TxTransfer

KiB, MiB = 1024, 1 << 20


class AckAudit:
    """Asserts, at the moment a DATA frame is written, that none of its bytes
    was acknowledged before (no acknowledged byte is ever sent again)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent = 0
        orig_send = FrameConnection.send
        audit = self

        def send(conn: FrameConnection, msg: object) -> None:
            if isinstance(msg, Data):
                audit.sent += 1
                end = msg.offset + msg.raw_length
                for t in audit.transfers:
                    for link, tid in t.opened.items():
                        if link.conn is conn and tid == msg.transfer_id:
                            assert not t.acked.overlaps(msg.offset, end), (
                                f"acked bytes [{msg.offset}, {end}) sent again"
                            )
            orig_send(conn, msg)  # type: ignore[arg-type]

        self.transfers: list[TxTransfer[object]] = []
        orig_init = TxTransfer.__init__

        def init(t: TxTransfer[object], *a: object, **k: object) -> None:
            orig_init(t, *a, **k)  # type: ignore[arg-type]
            audit.transfers.append(t)

        monkeypatch.setattr(FrameConnection, "send", send)
        monkeypatch.setattr(TxTransfer, "__init__", init)


def resume_case(
    resets: list[int | None],
    size: int,
    streams: int,
    chunk: int,
    corrupt: set[int] | None = None,
    placed: bool = False,
) -> None:
    """``placed``: the sink lends its memory, so chunks are read from the socket
    straight into it (a cut-off or damaged chunk is then rewritten by its
    resend); else every chunk goes through ``write``, each byte exactly once."""

    async def main() -> None:
        rx = await TcpReceiver().start()
        proxy = FaultProxy(rx.port, reset_after=resets, corrupt=corrupt)
        port = await proxy.start()
        tx = TcpSender("127.0.0.1", port, streams=streams, chunk_size=chunk, reconnect_timeout=10)
        data = os.urandom(size)
        sink = PlacedSink(size) if placed else OnceSink(size)
        h = rx.expect("r", sink, timeout=30)
        sh = tx.send("r", BytesSource(data), token=h.token, timeout=30)
        await sh.wait(30)
        await h.wait(30)
        assert bytes(sink.data) == data
        count = -(-size // chunk)
        assert h.stats.chunks == count  # every chunk verified and held exactly once
        if isinstance(sink, OnceSink):
            assert len(sink.spans) == count  # every chunk written exactly once
        else:
            assert sink.writes >= count and len(sink.views) >= h.stats.placed
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main(), 60)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    resets=st.lists(st.one_of(st.none(), st.integers(0, 3 * MiB)), min_size=1, max_size=6),
    size=st.integers(1, 3 * MiB),
    streams=st.integers(1, 3),
    chunk=st.sampled_from([64 * KiB, 256 * KiB]),
    corrupt=st.sets(st.integers(0, 40), max_size=3),
    placed=st.booleans(),
)
def test_resume_after_resets_at_random_points(
    monkeypatch: pytest.MonkeyPatch,
    resets: list[int | None],
    size: int,
    streams: int,
    chunk: int,
    corrupt: set[int],
    placed: bool,
) -> None:
    """Resets at random byte positions (mid-frame too), plus damaged chunks."""
    with monkeypatch.context() as mp:
        audit = AckAudit(mp)
        resume_case(resets, size, streams, chunk, corrupt, placed)
        assert audit.sent >= -(-size // chunk)


@pytest.mark.parametrize("placed", [False, True])
def test_resume_when_every_connection_drops_at_once(
    monkeypatch: pytest.MonkeyPatch, placed: bool
) -> None:
    AckAudit(monkeypatch)
    # all three first connections die mid-transfer; the sender reconnects
    resume_case([700 * KiB, 900 * KiB, 1100 * KiB], 6 * MiB, 3, 128 * KiB, placed=placed)


@pytest.mark.parametrize("placed", [False, True])
def test_damaged_chunks_are_resent_never_delivered(placed: bool) -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        proxy = FaultProxy(rx.port, corrupt={0, 3, 4, 9})
        port = await proxy.start()
        chunk = 256 * KiB if placed else 64 * KiB
        tx = TcpSender("127.0.0.1", port, streams=2, chunk_size=chunk)
        data = os.urandom(16 * chunk)
        sink = PlacedSink(len(data)) if placed else OnceSink(len(data))
        h = rx.expect("r", sink)
        stats = await tx.send("r", BytesSource(data), token=h.token).wait(20)
        await h.wait(20)
        assert bytes(sink.data) == data
        assert h.stats.bad_chunks == 4 and stats.retries == 4
        assert h.stats.chunks == 16
        if placed:  # read straight into the sink; the 4 damaged ones twice
            assert h.stats.placed == 16 and len(sink.views) == 20
        else:
            assert len(sink.spans) == 16
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main())


def test_keepalive_detects_silent_peer() -> None:
    async def main() -> None:
        rx = await TcpReceiver(keepalive_interval=0.05, keepalive_timeout=0.3).start()
        proxy = FaultProxy(rx.port)
        port = await proxy.start()
        tx = TcpSender(
            "127.0.0.1", port, streams=1, keepalive_interval=0.05, keepalive_timeout=0.3,
            reconnect_timeout=0.5,
        )  # fmt: skip
        await tx.connect()
        (link,) = tx._links
        proxy.stall = True  # the sender's bytes (its pings too) stop arriving
        await asyncio.wait_for(link.conn.wait_closed(), 5)
        assert isinstance(link.conn.close_error, PeerGone)
        proxy.stall = False
        await tx.close()
        await proxy.close()
        await rx.close()

    arun(main())


def test_sender_fails_with_peer_gone_when_receiver_disappears() -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2, chunk_size=64 * KiB, reconnect_timeout=0.3)
        h = rx.expect("r", BytesSink(64 * MiB))
        sh = tx.send("r", BytesSource(bytes(64 * MiB)), token=h.token)
        while sh.acked_bytes == 0:
            await asyncio.sleep(0.001)
        await rx.close()
        with pytest.raises((TransferAborted, PeerGone)) as ei:
            await sh.wait(10)
        if isinstance(ei.value, TransferAborted):
            assert ei.value.code == ErrorCode.SHUTDOWN
        await tx.close()

    arun(main())


# ---- hostile bytes on a real socket -----------------------------------------------------
async def raw_client(
    port: int, handshake: bool = True
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    if handshake:
        hs = ClientHandshake("raw", 0, capabilities=CODEC_CAPABILITIES)  # frames as in 5.3
        dec = FrameDecoder()
        w.write(encode_frame(hs.hello()))
        ack = dec.feed(await r.read(4096))[0]
        w.write(encode_frame(hs.on_hello_ack(ack)))  # type: ignore[arg-type]
        got = dec.feed(await r.read(4096))
        assert isinstance(got[0], Ready)
    return r, w


async def read_error(r: asyncio.StreamReader) -> Error:
    dec = FrameDecoder()
    while True:
        data = await asyncio.wait_for(r.read(65536), 5)
        assert data, "closed without an ERROR frame"
        for m in dec.feed(data):
            if isinstance(m, Error):
                return m


@pytest.mark.parametrize(
    "blob, code",
    [
        (b"GET / HTTP/1.1\r\n\r\n", ErrorCode.PROTOCOL_ERROR),
        (struct.pack("<IBBHI", 0x4642564B, 1, 0x12, 0, 0xFFFFFFF0), ErrorCode.FRAME_TOO_LARGE),
        (struct.pack("<IBBHI", 0x4642564B, 1, 0x2A, 0, 0), ErrorCode.PROTOCOL_ERROR),
        (struct.pack("<IBBHI", 0x4642564B, 9, 0x06, 0, 8) + bytes(8), ErrorCode.VERSION_MISMATCH),
        (encode_frame(Ready()), ErrorCode.PROTOCOL_ERROR),  # a sender may not send READY
    ],
)
def test_hostile_frames_after_handshake(blob: bytes, code: ErrorCode) -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        r, w = await raw_client(rx.port)
        w.write(blob)
        err = await read_error(r)
        assert err.code == code
        assert await asyncio.wait_for(r.read(), 5) == b""  # then it closes
        w.close()
        await w.wait_closed()
        await rx.close()

    arun(main())


def test_garbage_before_handshake_is_refused() -> None:
    async def main() -> None:
        rx = await TcpReceiver(handshake_timeout=1).start()
        r, w = await raw_client(rx.port, handshake=False)
        w.write(b"\x00" * 64)
        err = await read_error(r)
        assert err.code == ErrorCode.PROTOCOL_ERROR
        w.close()
        await w.wait_closed()
        assert rx.stats["handshake_failures"] == 1
        await rx.close()

    arun(main())


def test_token_guessing_closes_the_connection() -> None:
    async def main() -> None:
        limits = ReceiverLimits(max_unknown_tokens=3)
        rx = await TcpReceiver(limits=limits).start()
        r, w = await raw_client(rx.port)
        for i in range(5):
            w.write(encode_frame(Open(i + 1, os.urandom(16), 0, 10, 10, 0, 0, 0, 0, 0, 0, "x")))
        err = await read_error(r)
        assert err.code == ErrorCode.AUTH_FAILED
        w.close()
        await w.wait_closed()
        await rx.close()

    arun(main())


def test_connection_limit_per_peer() -> None:
    async def main() -> None:
        rx = await TcpReceiver(limits=ReceiverLimits(max_connections_per_peer=2)).start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2)
        await tx.connect()
        extra = TcpSender("127.0.0.1", rx.port, streams=1)
        with pytest.raises(ResourceLimit):
            await extra.connect()
        await extra.close()
        await tx.close()
        await rx.close()

    arun(main())


def test_handshake_and_connect_timeouts_are_typed() -> None:
    from kvbridge.errors import ConnectTimeout, HandshakeTimeout

    async def main() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read()  # accepts, never answers the HELLO
            w.close()

        srv = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        tx = TcpSender("127.0.0.1", port, streams=1, handshake_timeout=0.2, connect_timeout=0.5)
        with pytest.raises(HandshakeTimeout):
            await tx.connect()
        await tx.close()
        tx2 = TcpSender("127.0.0.1", port, streams=1, connect_timeout=1e-9)
        with pytest.raises(ConnectTimeout):
            await tx2.connect()
        await tx2.close()
        srv.close()
        await srv.wait_closed()

    arun(main())


def test_refused_connection_is_peer_gone_after_the_deadline() -> None:
    async def main() -> None:
        rx = await TcpReceiver().start()
        port = rx.port
        await rx.close()  # nothing listens there now
        tx = TcpSender("127.0.0.1", port, streams=2, connect_timeout=0.3)
        h = tx.send("r", BytesSource(b"x"), token=bytes(16))
        with pytest.raises(PeerGone):
            await h.wait(5)
        await tx.close()

    arun(main())


async def lent_sink_transfer(
    size: int,
) -> tuple[TcpReceiver, PlacedSink, ExpectHandle, asyncio.StreamReader, asyncio.StreamWriter]:
    """A receiver expecting ``size`` bytes into a sink that lends its memory,
    and a raw client that has opened the transfer (transfer id 1)."""
    rx = await TcpReceiver().start()
    sink = PlacedSink(size)
    h = rx.expect("r", sink)
    r, w = await raw_client(rx.port)
    while not any(c.peer for c in rx._conns):  # the receiver finished its handshake
        await asyncio.sleep(0.001)
    w.write(encode_frame(Open(1, h.token, 0, size, size, 0, 0, 0, 0, 0, 0, "r")))
    return rx, sink, h, r, w


def test_cancel_mid_chunk_stops_writes_into_a_lent_sink() -> None:
    """A chunk being read straight into the sink when the engine cancels: not
    one more byte lands there (the engine may reuse those pages at once)."""

    async def main() -> None:
        size = 2 * MiB
        rx, sink, h, _r, w = await lent_sink_transfer(size)
        payload = b"\xab" * size
        frame = encode_frame(Data(1, 0, 0, size, 0, 0, checksum(payload), payload))
        w.write(frame[:MiB])
        while sink.data.count(0xAB) < MiB // 2:  # the first bytes are in the sink
            await asyncio.sleep(0.005)
        assert sink.views == [(0, size)]
        h.cancel()
        await asyncio.sleep(0.05)
        landed = sink.data.count(0xAB)
        w.write(frame[MiB:])
        w.write(encode_frame(Ping(7)))
        await w.drain()
        await asyncio.sleep(0.2)
        assert sink.data.count(0xAB) == landed < size
        with pytest.raises(Cancelled):
            await h.wait(1)
        w.close()
        await rx.close()

    arun(main())


def test_damaged_chunk_read_into_a_lent_sink_is_not_acknowledged() -> None:
    async def main() -> None:
        size = MiB
        rx, sink, h, r, w = await lent_sink_transfer(size)
        payload = os.urandom(size)
        w.write(encode_frame(Data(1, 0, 0, size, 0, 0, checksum(payload) ^ 1, payload)))
        dec = FrameDecoder()
        seen: list[object] = []
        while not any(isinstance(m, Nack) for m in seen):
            seen += dec.feed(await asyncio.wait_for(r.read(65536), 5))
        assert not any(isinstance(m, Ack) for m in seen)
        assert h.received_bytes == 0 and h.stats.bad_chunks == 1 and not h.done()
        w.write(encode_frame(Data(1, 0, 0, size, 0, 0, checksum(payload), payload)))
        await h.wait(5)
        assert bytes(sink.data) == payload and len(sink.views) == 2
        w.close()
        await rx.close()

    arun(main())


def test_a_sink_whose_view_fails_fails_its_transfer_only() -> None:
    class BadView(BytesSink):
        def view(self, offset: int, n: int) -> memoryview:
            return memoryview(bytes(n))  # read-only: not a place to receive into

    async def main() -> None:
        rx = await TcpReceiver().start()
        tx = TcpSender("127.0.0.1", rx.port, streams=2, chunk_size=256 * KiB)
        bad = rx.expect("bad", BadView(MiB))
        s = tx.send("bad", BytesSource(bytes(MiB)), token=bad.token)
        with pytest.raises(TransferAborted) as ei:
            await s.wait(10)
        assert ei.value.code == ErrorCode.SINK_ERROR
        with pytest.raises(InvalidArgument):
            await bad.wait(1)
        data = os.urandom(MiB)  # the connections and other transfers carry on
        good = PlacedSink(MiB)
        h = rx.expect("good", good)
        await tx.send("good", BytesSource(data), token=h.token).wait(10)
        await h.wait(10)
        assert bytes(good.data) == data
        await tx.close()
        await rx.close()

    arun(main())
