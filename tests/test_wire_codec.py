"""The sans-IO frame codec: exact round trips, incremental parsing, rejection
of hostile input with typed errors, and a hypothesis fuzz."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import (
    FrameTooLarge,
    KVBridgeError,
    RemoteProtocolError,
    UnknownFrame,
    VersionMismatch,
)
from kvbridge.wire import FrameDecoder, encode_frame
from kvbridge.wire.chunk import checksum
from kvbridge.wire.frames import (
    HEADER_SIZE,
    MAGIC,
    Abort,
    Ack,
    Auth,
    Complete,
    Control,
    Data,
    DataHead,
    Error,
    Hello,
    HelloAck,
    Nack,
    Open,
    Ping,
    Pong,
    Ready,
    Resume,
)

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
U16 = st.integers(0, 2**16 - 1)
U8 = st.integers(0, 255)
TEXT = st.text(max_size=40)
RANGES = st.lists(st.tuples(U64, U64), max_size=5).map(tuple)

MESSAGES = st.one_of(
    st.builds(Hello, U8, U8, U8, U64, U32, U32, st.binary(min_size=32, max_size=32), TEXT),
    st.builds(
        HelloAck,
        U8,
        U8,
        U64,
        U32,
        U32,
        st.binary(min_size=32, max_size=32),
        st.binary(min_size=32, max_size=32),
        TEXT,
    ),
    st.builds(Auth, st.binary(min_size=32, max_size=32)),
    st.just(Ready()),
    st.builds(Error, U16, TEXT),
    st.builds(Ping, U64),
    st.builds(Pong, U64),
    st.builds(
        Open,
        U64,
        st.binary(min_size=16, max_size=16),
        U64,
        U64,
        U32,
        U32,
        U32,
        U16,
        U16,
        U8,
        U8,
        TEXT,
    ),
    st.builds(Resume, U64, RANGES),
    st.builds(
        lambda tid, seq, off, raw, codec, shuf, data: Data(
            tid, seq, off, raw, codec, shuf, checksum(data), data
        ),
        U64,
        U64,
        U64,
        U32,
        U8,
        U8,
        st.binary(max_size=300),
    ),
    st.builds(Ack, U64, RANGES),
    st.builds(Nack, U64, U64, U64, U16),
    st.builds(Abort, U64, U16, TEXT),
    st.builds(Complete, U64, U64),
    st.builds(Control, st.integers(0x40, 0xFF), st.integers(0, 0xFF), st.binary(max_size=100)),
)


def norm(m: object) -> object:
    if isinstance(m, Data):
        return (
            m.transfer_id,
            m.seq,
            m.offset,
            m.raw_length,
            m.codec,
            m.shuffle,
            m.checksum,
            bytes(m.data),
        )
    return m


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MESSAGES, min_size=1, max_size=6), st.data())
def test_round_trip_any_split(msgs: list[object], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)  # type: ignore[arg-type]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec = FrameDecoder()
    out: list[object] = []
    prev = 0
    for c in [*cuts, len(stream)]:
        out += dec.feed(stream[prev:c])
        prev = c
    assert [norm(m) for m in out] == [norm(m) for m in msgs]
    assert dec.buffered == 0


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_garbage_raises_only_typed_errors(blob: bytes) -> None:
    dec = FrameDecoder(max_payload=1 << 16)
    try:
        dec.feed(blob)
    except KVBridgeError:
        pass


@settings(max_examples=300, deadline=None)
@given(MESSAGES, st.integers(0, 400), st.integers(0, 255))
def test_fuzz_mutated_frames(msg: object, pos: int, xor: int) -> None:
    frame = bytearray(encode_frame(msg))  # type: ignore[arg-type]
    frame[pos % len(frame)] ^= xor
    dec = FrameDecoder(max_payload=1 << 16)
    try:
        dec.feed(bytes(frame))
    except KVBridgeError:
        pass


def header(ftype: int, length: int, version: int = 1, magic: int = MAGIC, flags: int = 0) -> bytes:
    return struct.pack("<IBBHI", magic, version, ftype, flags, length)


def test_oversize_rejected_before_payload_arrives() -> None:
    dec = FrameDecoder(max_payload=1000)
    with pytest.raises(FrameTooLarge):
        dec.feed(header(0x12, 1001))  # the payload never comes: no allocation
    with pytest.raises(FrameTooLarge):  # stays failed
        dec.feed(b"x")


def test_huge_length_rejected() -> None:
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed(header(0x12, 0xFFFFFFFF))


@pytest.mark.parametrize("ftype", [0x00, 0x08, 0x17, 0x20, 0x3F])
def test_unknown_core_type(ftype: int) -> None:
    with pytest.raises(UnknownFrame):
        FrameDecoder().feed(header(ftype, 0))


def test_bad_magic() -> None:
    with pytest.raises(RemoteProtocolError, match="magic"):
        FrameDecoder().feed(header(0x06, 8, magic=0x12345678) + bytes(8))


def test_version_mismatch() -> None:
    dec = FrameDecoder()
    dec.version = 1
    with pytest.raises(VersionMismatch):
        dec.feed(header(0x06, 8, version=2) + bytes(8))
    # before negotiation, only HELLO/ERROR may carry another version
    with pytest.raises(VersionMismatch):
        FrameDecoder().feed(header(0x10, 0, version=7))
    hello = bytearray(encode_frame(Hello(1, 3, 0, 0, 1 << 20, 0, bytes(32), "x")))
    hello[4] = 3
    assert isinstance(FrameDecoder().feed(bytes(hello))[0], Hello)


def test_unknown_critical_flag_rejected_optional_ignored() -> None:
    ping = encode_frame(Ping(7))
    opt = ping[:6] + struct.pack("<H", 0x0001) + ping[8:]
    assert FrameDecoder().feed(opt) == [Ping(7)]
    crit = ping[:6] + struct.pack("<H", 0x0100) + ping[8:]
    with pytest.raises(RemoteProtocolError, match="critical"):
        FrameDecoder().feed(crit)


def test_appended_fields_are_ignored() -> None:
    frame = encode_frame(Complete(3, 99))
    longer = frame[:8] + struct.pack("<I", 16 + 5) + frame[HEADER_SIZE:] + b"extra"
    assert FrameDecoder().feed(longer) == [Complete(3, 99)]
    data = Data(1, 0, 0, 3, 0, 0, checksum(b"abc"), b"abc")
    f = encode_frame(data)
    body = f[HEADER_SIZE:]
    ext = f[:8] + struct.pack("<I", len(body) + 4) + body[:44] + b"EXT!" + body[44:]
    (got,) = FrameDecoder().feed(ext)
    assert isinstance(got, Data) and bytes(got.data) == b"abc"


@pytest.mark.parametrize(
    "msg",
    [
        Open(1, bytes(16), 2, 3, 4, 5, 6, 7, 8, 9, 10, "req"),
        Hello(1, 1, 0, 0, 1 << 20, 0, bytes(32), "ident"),
        Abort(1, 2, "why"),
        Ack(1, ((0, 10), (20, 10))),
        Data(1, 0, 0, 5, 0, 0, 0, b"hello"),
    ],
)
def test_truncated_payloads(msg: object) -> None:
    frame = encode_frame(msg)  # type: ignore[arg-type]
    body = frame[HEADER_SIZE:]
    for cut in range(len(body) - (5 if isinstance(msg, Data) else 0)):
        short = frame[:8] + struct.pack("<I", cut) + body[:cut]
        if isinstance(msg, Data) and cut >= 44:
            continue  # wire length covers less than 5 bytes: checked below
        with pytest.raises(RemoteProtocolError):
            FrameDecoder().feed(short)
    if isinstance(msg, Data):
        short = frame[:8] + struct.pack("<I", 44 + 4) + body[: 44 + 4]
        with pytest.raises(RemoteProtocolError, match="wire length"):
            FrameDecoder().feed(short)


def test_ranges_count_bounded_by_payload() -> None:
    frame = bytearray(encode_frame(Ack(1, ((0, 1),))))
    struct.pack_into("<I", frame, HEADER_SIZE + 8, 1_000_000)
    with pytest.raises(RemoteProtocolError, match="range count"):
        FrameDecoder().feed(bytes(frame))


def test_bad_utf8_reason() -> None:
    frame = bytearray(encode_frame(Abort(1, 2, "ab")))
    frame[-1] = 0xFF
    with pytest.raises(RemoteProtocolError, match="UTF-8"):
        FrameDecoder().feed(bytes(frame))


def test_control_frames_pass_through_opaque() -> None:
    msgs = [Control(0x40, 0, b"handoff"), Control(0x7F, 0x3, b""), Control(0xC0, 0, b"x" * 70000)]
    dec = FrameDecoder()
    out = dec.feed(b"".join(encode_frame(m) for m in msgs))
    assert out == msgs


def test_large_frame_received_in_own_buffer() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    msg = Data(9, 0, 0, len(payload), 0, 0, checksum(payload), payload)
    frame = encode_frame(msg)
    dec = FrameDecoder()
    got: list[object] = []
    pos = 0
    while pos < len(frame):  # the BufferedProtocol path
        buf = dec.get_buffer()
        n = min(len(buf), 50_000, len(frame) - pos)
        buf[:n] = frame[pos : pos + n]
        pos += n
        got += dec.buffer_updated(n)
    assert len(got) == 1 and isinstance(got[0], Data)
    assert bytes(got[0].data) == payload
    assert got[0].digest == checksum(payload)  # hashed piece by piece on arrival


def _pump(dec: FrameDecoder, stream: bytes, step: int) -> list[object]:
    """Feed ``stream`` through get_buffer/buffer_updated, at most ``step`` bytes a read."""
    out: list[object] = []
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer()
        n = min(len(buf), step, len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        pos += n
        out += dec.buffer_updated(n)
    return out


@pytest.mark.parametrize("size", [5000, 70_000, 600_000])
@pytest.mark.parametrize("step", [7, 4096, 1 << 20])
def test_place_receives_chunk_bytes_straight_into_the_destination(size: int, step: int) -> None:
    """Whole frames in the staging buffer and large ones alike land in the
    view that ``place`` returns; the digest is computed on the way."""
    dest = bytearray(2 * size)
    payloads = [bytes([i + 1]) * size for i in range(2)]
    frames = [
        encode_frame(Data(3, i, i * size, size, 0, 0, checksum(p), p))
        for i, p in enumerate(payloads)
    ]
    asked: list[tuple[int, int]] = []

    def place(head: DataHead) -> memoryview:
        asked.append((head.seq, head.wire_length))
        return memoryview(dest)[head.offset : head.offset + head.wire_length]

    dec = FrameDecoder(place=place)
    ping = encode_frame(Ping(5))
    got = _pump(dec, ping + frames[0] + ping + frames[1], step)
    assert [type(m) for m in got] == [Ping, Data, Ping, Data]
    assert asked == [(0, size), (1, size)]
    assert bytes(dest) == b"".join(payloads)
    for m, p in zip((got[1], got[3]), payloads, strict=True):
        assert isinstance(m, Data) and m.placed and m.digest == checksum(p) == m.checksum
        assert m.data.obj is dest  # type: ignore[union-attr]


def test_place_declined_or_damaged_and_small_frames() -> None:
    payload = bytes(range(256)) * 1024
    bad = Data(1, 0, 0, len(payload), 0, 0, checksum(payload) ^ 1, payload)
    dec = FrameDecoder(place=lambda head: None)  # declined: own allocation, still hashed
    (m,) = _pump(dec, encode_frame(bad), 10_000)
    assert isinstance(m, Data) and not m.placed and m.digest == checksum(payload) != m.checksum
    tiny = Data(1, 0, 0, 100, 0, 0, checksum(b"x" * 100), b"x" * 100)
    calls: list[object] = []
    dec = FrameDecoder(place=lambda head: calls.append(head))  # type: ignore[func-returns-value]
    (m,) = _pump(dec, encode_frame(tiny), 1 << 20)
    assert calls == [] and m == tiny and m.digest is None  # below the size worth placing


def test_place_must_return_the_exact_size() -> None:
    payload = bytes(300_000)
    frame = encode_frame(Data(1, 0, 0, len(payload), 0, 0, checksum(payload), payload))
    dec = FrameDecoder(place=lambda head: memoryview(bytearray(10)))
    with pytest.raises(ValueError):
        _pump(dec, frame, 1 << 20)


def test_discard_current_stops_writing_into_a_placed_view() -> None:
    size = 600_000
    dest = bytearray(size)
    payload = b"\xab" * size
    frame = encode_frame(Data(1, 0, 0, size, 0, 0, checksum(payload), payload))
    dec = FrameDecoder(place=lambda head: memoryview(dest))
    cut = 100_000
    assert _pump(dec, frame[:cut], 1 << 20) == []
    written = dest.count(0xAB)
    assert 0 < written < size
    dec.discard_current()  # e.g. the transfer was cancelled: the pages go back to the engine
    after = _pump(dec, frame[cut:] + encode_frame(Ping(1)), 50_000)
    assert after == [Ping(1)]  # the rest is read and dropped, the stream goes on
    assert dest.count(0xAB) == written


def test_critical_flags_are_never_placed() -> None:
    payload = bytes(300_000)
    frame = bytearray(encode_frame(Data(1, 0, 0, len(payload), 0, 0, checksum(payload), payload)))
    struct.pack_into("<H", frame, 6, 0x0100)  # an unknown critical flag
    calls: list[object] = []
    dec = FrameDecoder(place=lambda head: calls.append(head))  # type: ignore[func-returns-value]
    with pytest.raises(RemoteProtocolError):
        _pump(dec, bytes(frame), 1 << 20)
    assert calls == []


def _decode_all(stream: bytes, cuts: list[int], place: bool) -> tuple[list[object], str]:
    """Every message of ``stream`` fed at ``cuts``, normalized, and the name of
    the error that stopped it ("" if none); with ``place``, large DATA payloads
    land in views lent by a place() callback."""
    lent: list[bytearray] = []

    def lend(head: DataHead) -> memoryview:
        lent.append(bytearray(head.wire_length))
        return memoryview(lent[-1])

    dec = FrameDecoder(max_payload=1 << 20, place=lend if place else None)
    out: list[object] = []
    err = ""
    prev = 0
    try:
        for c in [*cuts, len(stream)]:
            for m in dec.feed(stream[prev:c]):
                if isinstance(m, Data) and m.digest is not None:
                    assert m.digest == checksum(m.data)  # hashed as it arrived
                    assert m.placed == place
                out.append(norm(m))
            prev = c
    except KVBridgeError as e:
        err = type(e).__name__
    return out, err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("big"), st.integers(65_537, 300_000), st.integers(0, 2**32 - 1)),
            MESSAGES.map(lambda m: ("msg", m, 0)),
        ),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_placing_changes_nothing_but_where_bytes_land(
    frames: list[tuple], data: st.DataObject
) -> None:
    """Differential: with or without place(), any stream (valid, with large
    DATA frames, then maybe one flipped byte) decodes to the same messages and
    fails with the same error."""
    import numpy as np

    parts = []
    for kind, a, b in frames:
        if kind == "big":
            body = np.random.default_rng(b).integers(0, 256, a, dtype=np.uint8).tobytes()
            parts.append(encode_frame(Data(b, b % 7, b, a, 0, 0, checksum(body), body)))
        else:
            parts.append(encode_frame(a))
    stream = bytearray(b"".join(parts))
    if data.draw(st.booleans()):
        stream[data.draw(st.integers(0, len(stream) - 1))] ^= data.draw(st.integers(1, 255))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    assert _decode_all(bytes(stream), cuts, place=False) == _decode_all(
        bytes(stream), cuts, place=True
    )
