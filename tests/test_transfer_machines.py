"""The TCP transfer rules without sockets, threads or an event loop: the
sans-IO state machines (kvbridge.wire.txtransfer, kvbridge.wire.rxtransfer)
fed messages and the time.

Every resume, NACK, abort and linger case of the socket-level suites
(test_tcp_protocol, test_tcp_transfer, test_tcp_faults) is here, plus what
the byte-range bookkeeping adds: another chunk size on a later OPEN, parts of
chunks, the ack timer, the reconnect clock and layer-wise readiness."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import (
    AuthenticationError,
    Cancelled,
    ChecksumError,
    DecompressError,
    ErrorCode,
    IncompatiblePeer,
    KVBridgeError,
    PeerGone,
    RemoteProtocolError,
    SourceConflict,
    TransferAborted,
    TransferTimeout,
)
from kvbridge.wire.chunk import checksum, decode_chunk
from kvbridge.wire.frames import (
    Abort,
    Ack,
    Complete,
    Data,
    DataHead,
    Message,
    Nack,
    Open,
    Resume,
)
from kvbridge.wire.ranges import RangeSet
from kvbridge.wire.rxtransfer import (
    Flush,
    Forget,
    Reply,
    Resolve,
    RxLimits,
    RxState,
    RxTransfer,
    StopPlacing,
    Write,
)
from kvbridge.wire.txtransfer import (
    AbortUnopened,
    AckClock,
    Finished,
    LinkClock,
    SendAbort,
    TxLimits,
    TxState,
    TxTransfer,
    Wake,
    _Flight,
)

TOKEN = bytes(range(16))
BIG = 1 << 30


def rx_for(
    total: int, *, linger: float = 30.0, bad: int = 32, place: bool = False
) -> RxTransfer[str]:
    return RxTransfer(
        "req", total, deadline=100.0, now=0.0, can_place=place,
        limits=RxLimits(max_frame=BIG, max_bad_chunks=bad, linger_s=linger),
    )  # fmt: skip


def tx_for(
    total: int, *, now: float = 0.0, clock: AckClock | None = None, **lim: object
) -> TxTransfer[str]:
    return TxTransfer(
        "req", TOKEN, total, deadline=100.0, now=now, clock=clock or AckClock(1.0),
        limits=TxLimits(**lim),  # type: ignore[arg-type]
    )  # fmt: skip


def open_msg(
    tid: int, total: int, chunk: int, ranges: tuple[int, int, int, int] = (0, 0, 0, 0)
) -> Open:
    return Open(tid, TOKEN, 0, total, chunk, *ranges, 7, 0, "req")


def data(tid: int, chunk: int, off: int, body: bytes, *, ck: int | None = None) -> Data:
    c = checksum(body) if ck is None else ck
    return Data(tid, off // chunk, off, len(body), 0, 0, c, body)


def replies(outs: list[object], conn: str | None = None) -> list[Message]:
    return [o.message for o in outs if isinstance(o, Reply) and (conn is None or o.conn == conn)]


def only(outs: list[object], kind: type) -> list[object]:
    return [o for o in outs if isinstance(o, kind)]


# ---- a socket-free pair: one TxTransfer, one RxTransfer, any number of connections ----------
@dataclass
class Pair:
    """Moves messages between a sender and a receiver state machine at once,
    writing into ``dest``; ``drop(frame)`` and ``damage(frame)`` pick DATA
    frames to lose or to damage in their body.  Records every byte range
    written (to prove no byte is written twice)."""

    payload: bytes
    tx: TxTransfer[str]
    rx: RxTransfer[str]
    now: float = 0.0
    dest: bytearray = field(default_factory=bytearray)
    written: list[tuple[int, int]] = field(default_factory=list)
    sent: list[Data] = field(default_factory=list)
    tids: dict[str, int] = field(default_factory=dict)
    ranged: dict[str, bool] = field(default_factory=dict)
    drop: object = None
    damage: object = None
    tx_done: list[KVBridgeError | None] = field(default_factory=list)
    rx_done: list[KVBridgeError | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dest = bytearray(len(self.payload))

    # connections
    def connect(self, conn: str, ranged: bool = True) -> None:
        self.ranged[conn] = ranged
        self.tids[conn] = self.tids.get(conn, 0) + 1
        self.tx.links_changed(len(self.ranged), self.now)

    def lose(self, conn: str) -> None:
        del self.ranged[conn]
        self.tx_apply(self.tx.link_lost(conn, self.now))
        self.tx.links_changed(len(self.ranged), self.now)
        self.rx_apply(self.rx.conn_lost(conn, self.now))

    def open(self, conn: str) -> None:
        tid = self.tids[conn]
        self.tx.attach(conn, tid)
        m = self.tx.open_message(tid, 7)
        self.rx_apply(self.rx.on_open(conn, m, self.ranged[conn], self.now), conn)

    # the two directions
    def tx_apply(self, outs: list[object]) -> None:
        for o in outs:
            if isinstance(o, SendAbort):
                self.rx_apply(self.rx.on_abort(o.link, o.message, self.now))
            elif isinstance(o, Finished):
                self.tx_done.append(o.error)

    def rx_apply(self, outs: list[object], conn: str | None = None) -> None:
        for o in outs:
            if isinstance(o, Reply):
                if o.conn in self.ranged and isinstance(
                    o.message, Ack | Resume | Nack | Abort | Complete
                ):
                    self.tx_apply(self.tx.on_message(o.conn, o.message, self.now))
            elif isinstance(o, Write):
                d = o.data
                try:
                    raw = decode_chunk(d.data, d.raw_length, d.codec, d.shuffle, d.checksum)
                except ChecksumError as e:
                    self.rx_apply(self.rx.write_failed(o.job, e, self.now))
                    continue
                for a, b in o.pieces:
                    for x, y in self.written:
                        assert b <= x or a >= y, f"bytes [{a}, {b}) written twice"
                    self.written.append((a, b))
                    self.dest[a:b] = bytes(raw)[a - d.offset : b - d.offset]
                self.rx_apply(self.rx.written(o.job, self.now))
            elif isinstance(o, Flush):
                self.rx_apply(self.rx.flushed(self.now))
            elif isinstance(o, Resolve):
                self.rx_done.append(o.error)

    def send_one(self, conn: str) -> bool:
        """The sender's next chunk on ``conn``; False when none is pending."""
        tx = self.tx
        if not tx.has_pending():
            return False
        if conn not in tx.opened:
            self.open(conn)
        idx = tx.pop_pending()
        pieces = tx.pieces(idx, self.ranged[conn])
        if not pieces:
            return True
        tx.claim(conn, idx)
        frames = []
        for off, n in pieces:
            body = self.payload[off : off + n]
            frames.append(Data(tx.opened[conn], idx, off, n, 0, 0, checksum(body), body))
        tx.sent(conn, idx, len(frames), self.now)
        for f in frames:
            self.sent.append(f)
            if callable(self.drop) and self.drop(f):
                continue
            if callable(self.damage) and self.damage(f):
                f = Data(f.transfer_id, f.seq, f.offset, f.raw_length, 0, 0, f.checksum ^ 1, f.data)
            self.rx_apply(self.rx.on_data(conn, f, self.now), conn)
        return True

    def run(self, conns: list[str], *, until: float = 60.0, step: float = 0.25) -> None:
        """Send round-robin until the sender finished, advancing time (and
        polling both machines) whenever nothing is pending."""
        i = 0
        while not self.tx.finished and self.now < until:
            live = [c for c in conns if c in self.ranged]
            if live and self.send_one(live[i % len(live)]):
                i += 1
                continue
            self.now += step
            self.tx_apply(self.tx.poll(self.now))
            self.rx_apply(self.rx.poll(self.now))

    @property
    def sent_bytes(self) -> int:
        return sum(f.raw_length for f in self.sent)


def pair(size: int, chunk: int, **kw: object) -> Pair:
    p = Pair(os.urandom(size), tx_for(size, **kw), rx_for(size))  # type: ignore[arg-type]
    p.tx.start(chunk, 0.0)
    return p


# ---- the byte-range set ---------------------------------------------------------------------
def test_rangeset_against_a_bitmap() -> None:
    import random

    rng = random.Random(7)
    for _ in range(200):
        rs, bits = RangeSet(), [False] * 64
        for _ in range(12):
            a = rng.randrange(64)
            b = rng.randrange(a, 65)
            if rng.random() < 0.7:
                new = rs.add(a, b)
                assert new == sum(1 for i in range(a, b) if not bits[i])
                bits[a:b] = [True] * (b - a)
            else:
                rs.remove(a, b)
                bits[a:b] = [False] * (b - a)
            assert rs.total == sum(bits)
            x = rng.randrange(64)
            y = rng.randrange(x, 65)
            assert rs.covers(x, y) == all(bits[x:y])
            assert rs.overlaps(x, y) == any(bits[x:y])
            miss = {i for a2, b2 in rs.missing(x, y) for i in range(a2, b2)}
            assert miss == {i for i in range(x, y) if not bits[i]}
            spans = rs.spans()  # coalesced, ascending
            assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in itertools.pairwise(spans))


# ---- the receiver: OPEN, RESUME, DATA, duplicates, NACK, COMPLETE ----------------------------
def test_receiver_open_data_duplicate_nack_complete() -> None:
    rx = rx_for(25)
    payload = os.urandom(25)
    outs = rx.on_open("a", open_msg(6, 25, 10), False, 0.0)
    assert replies(outs) == [Resume(6, ())] and rx.state is RxState.RECEIVING
    (w1,) = only(rx.on_data("a", data(6, 10, 10, payload[10:20]), 0.0), Write)
    (w0,) = only(rx.on_data("a", data(6, 10, 0, payload[:10], ck=1), 0.0), Write)
    assert isinstance(w1, Write) and w1.pieces == ((10, 20),)
    assert replies(rx.written(w1.job, 0.0)) == [Ack(6, ((10, 10),))]
    assert isinstance(w0, Write)
    assert replies(rx.write_failed(w0.job, ChecksumError("x"), 0.0)) == [
        Nack(6, 0, 10, ErrorCode.CHECKSUM)
    ]
    # a duplicate of a held chunk: acknowledged again, never written again
    assert rx.on_data("a", data(6, 10, 10, payload[10:20]), 0.0) == [
        Reply("a", Ack(6, ((10, 10),)))
    ]
    (w0,) = only(rx.on_data("a", data(6, 10, 0, payload[:10]), 0.0), Write)
    (w2,) = only(rx.on_data("a", data(6, 10, 20, payload[20:]), 0.0), Write)
    assert isinstance(w0, Write) and isinstance(w2, Write)
    rx.written(w0.job, 0.0)
    assert only(rx.written(w2.job, 0.0), Flush) == [Flush()]
    assert rx.state is RxState.FLUSHING
    outs = rx.flushed(1.0)
    assert outs == [Resolve(None), Reply("a", Complete(6, 25))]
    assert (rx.duplicates, rx.bad_chunks, rx.chunks, rx.received_bytes) == (1, 1, 3, 25)


def test_receiver_damaged_body_kinds_are_nacked_by_code() -> None:
    rx = rx_for(30)
    rx.on_open("a", open_msg(1, 30, 10), False, 0.0)
    jobs = [only(rx.on_data("a", data(1, 10, o, bytes(10)), 0.0), Write)[0] for o in (0, 10)]
    out = rx.write_failed(jobs[0].job, DecompressError("short"), 0.0)  # type: ignore[attr-defined]
    out += rx.write_failed(jobs[1].job, ChecksumError("bad"), 0.0)  # type: ignore[attr-defined]
    assert replies(out) == [
        Nack(1, 0, 10, ErrorCode.DECOMPRESS),
        Nack(1, 10, 10, ErrorCode.CHECKSUM),
    ]
    assert rx.received_bytes == 0 and rx.running


@pytest.mark.parametrize(
    ("seq", "off", "n", "ranged"),
    [(0, 3, 10, False), (1, 0, 10, False), (0, 0, 9, False), (2, 20, 10, False), (0, 5, 6, True),
     (1, 5, 5, True), (0, 0, 0, True), (0, 30, 1, True)],
)  # fmt: skip
def test_receiver_off_grid_data_is_a_protocol_error(
    seq: int, off: int, n: int, ranged: bool
) -> None:
    rx = rx_for(25)
    rx.on_open("a", open_msg(1, 25, 10), ranged, 0.0)
    with pytest.raises(RemoteProtocolError):
        rx.on_data("a", Data(1, seq, off, n, 0, 0, checksum(bytes(n)), bytes(n)), 0.0)
    assert rx.running and rx.received_bytes == 0  # the transfer lives on (the connection closes)


def test_receiver_unknown_codec_is_a_protocol_error_the_transfer_lives_on() -> None:
    rx = rx_for(10)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    with pytest.raises(RemoteProtocolError):
        rx.on_data("a", Data(1, 0, 0, 10, 9, 0, checksum(bytes(10)), bytes(10)), 0.0)
    rx.conn_lost("a", 0.0)
    rx.on_open("b", open_msg(1, 10, 10), False, 0.0)
    (w,) = only(rx.on_data("b", data(1, 10, 0, bytes(10)), 0.0), Write)
    assert only(rx.written(w.job, 0.0), Flush)  # type: ignore[attr-defined]


def test_receiver_later_opens_attach_once_and_keep_the_first_ranges() -> None:
    rx = rx_for(20)
    assert replies(rx.on_open("a", open_msg(1, 20, 10, (0, 5, 0, 2)), False, 0.0)) == [
        Resume(1, ())
    ]
    (again,) = replies(rx.on_open("a", open_msg(2, 20, 10, (0, 5, 0, 2)), False, 0.0))
    assert isinstance(again, Abort) and again.code == ErrorCode.TRANSFER_MISMATCH
    assert "already open" in again.reason
    (other,) = replies(rx.on_open("b", open_msg(1, 20, 10, (0, 6, 0, 2)), False, 0.0))
    assert isinstance(other, Abort) and "first OPEN" in other.reason
    assert rx.running  # the transfer carries on


@pytest.mark.parametrize(
    "bad",
    [Open(1, TOKEN, 0, 20, 10, 0, 0, 0, 0, 7, 0, "other"), Open(1, TOKEN, 0, 21, 10, 0, 0, 0, 0, 7, 0, "req"),
     Open(1, TOKEN, 5, 20, 10, 0, 0, 0, 0, 7, 0, "req"), Open(1, TOKEN, 0, 20, 0, 0, 0, 0, 0, 7, 0, "req")],
)  # fmt: skip
def test_receiver_first_open_that_does_not_fit_fails_the_transfer(bad: Open) -> None:
    rx = rx_for(20)
    outs = rx.on_open("a", bad, False, 0.0)
    (abort,) = replies(outs)
    assert isinstance(abort, Abort) and abort.code == ErrorCode.TRANSFER_MISMATCH
    (res,) = only(outs, Resolve)
    assert isinstance(res, Resolve) and isinstance(res.error, IncompatiblePeer)
    (late,) = replies(rx.on_open("a", open_msg(2, 20, 10), False, 1.0))
    assert isinstance(late, Abort) and late.code == ErrorCode.CANCELLED


def test_receiver_zero_byte_transfer_completes_on_open() -> None:
    rx = rx_for(0)
    outs = rx.on_open("a", open_msg(1, 0, 10), False, 0.0)
    assert replies(outs) == [Resume(1, ())] and only(outs, Flush)
    assert rx.flushed(0.0)[-1] == Reply("a", Complete(1, 0))


def test_receiver_striped_duplicate_is_acknowledged_on_both_connections_once_written() -> None:
    rx = rx_for(10)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    rx.on_open("b", open_msg(4, 10, 10), False, 0.0)
    body = os.urandom(10)
    (w,) = only(rx.on_data("a", data(1, 10, 0, body), 0.0), Write)
    assert rx.on_data("b", data(4, 10, 0, body), 0.0) == []  # under way: not written again
    outs = rx.written(w.job, 0.0)  # type: ignore[attr-defined]
    assert set(replies(outs)) == {Ack(1, ((0, 10),)), Ack(4, ((0, 10),))}
    assert rx.duplicates == 1 and rx.chunks == 1


def test_receiver_a_failed_write_nacks_every_frame_that_waited_on_it() -> None:
    rx = rx_for(10)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    rx.on_open("b", open_msg(4, 10, 10), False, 0.0)
    (w,) = only(rx.on_data("a", data(1, 10, 0, bytes(10)), 0.0), Write)
    rx.on_data("b", data(4, 10, 0, bytes(10)), 0.0)
    outs = rx.write_failed(w.job, ChecksumError("bad"), 0.0)  # type: ignore[attr-defined]
    assert set(replies(outs)) == {
        Nack(1, 0, 10, ErrorCode.CHECKSUM),
        Nack(4, 0, 10, ErrorCode.CHECKSUM),
    }


def test_receiver_damaged_chunk_limit_aborts_with_checksum() -> None:
    rx = rx_for(10, bad=2)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    for _ in range(3):
        (w,) = only(rx.on_data("a", data(1, 10, 0, bytes(10)), 0.0), Write)
        outs = rx.write_failed(w.job, ChecksumError("bad"), 0.0)  # type: ignore[attr-defined]
    assert replies(outs)[0] == Nack(1, 0, 10, ErrorCode.CHECKSUM)  # the 3rd is NACKed too, then
    (abort,) = [m for m in replies(outs) if isinstance(m, Abort)]
    assert isinstance(abort, Abort) and abort.code == ErrorCode.CHECKSUM
    assert isinstance(only(outs, Resolve)[0].error, ChecksumError)  # type: ignore[attr-defined]


def test_receiver_cut_off_placed_chunk_is_needed_again() -> None:
    rx = rx_for(10, place=True)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    rx.on_open("b", open_msg(2, 10, 10), False, 0.0)
    head = DataHead(1, 0, 0, 10, 10, 0, 0, 0)
    job = rx.place("a", head)
    assert job is not None and rx.place("b", DataHead(2, 0, 0, 10, 10, 0, 0, 0)) is None
    assert rx.on_data("b", data(2, 10, 0, bytes(10)), 0.0) == []  # waits for the placed one
    outs = rx.conn_lost("a", 0.0)  # cut off mid-frame
    assert replies(outs) == [Nack(2, 0, 10, ErrorCode.CHECKSUM)]
    assert rx.place("b", DataHead(2, 0, 0, 10, 10, 0, 0, 0)) is not None


def test_receiver_damaged_placed_chunk_is_not_acknowledged() -> None:
    rx = rx_for(10, place=True)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    body = os.urandom(10)
    assert rx.place("a", DataHead(1, 0, 0, 10, 10, 0, 0, checksum(body))) is not None
    m = Data(1, 0, 0, 10, 0, 0, checksum(body), body, digest=checksum(body) ^ 1, placed=True)
    assert replies(rx.on_data("a", m, 0.0)) == [Nack(1, 0, 10, ErrorCode.CHECKSUM)]
    assert rx.place("a", DataHead(1, 0, 0, 10, 10, 0, 0, checksum(body))) is not None
    m = Data(1, 0, 0, 10, 0, 0, checksum(body), body, digest=checksum(body), placed=True)
    outs = rx.on_data("a", m, 0.0)
    assert replies(outs) == [Ack(1, ((0, 10),))] and only(outs, Flush) and rx.placed == 1


def test_receiver_cancel_stops_placing_and_aborts_every_attached_connection() -> None:
    rx = rx_for(10, place=True)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    rx.on_open("b", open_msg(3, 10, 10), False, 0.0)
    rx.place("a", DataHead(1, 0, 0, 10, 10, 0, 0, 0))
    outs = rx.cancel(Cancelled("engine"), ErrorCode.CANCELLED, 0.0)
    assert outs[0] == StopPlacing("a")
    assert {(m.transfer_id, m.code) for m in replies(outs)} == {(1, 9), (3, 9)}  # type: ignore[attr-defined]
    assert isinstance(only(outs, Resolve)[0].error, Cancelled)  # type: ignore[attr-defined]
    # the placed frame arriving after the cancel is dropped
    m = Data(1, 0, 0, 10, 0, 0, 0, bytes(10), digest=0, placed=True)
    assert rx.on_data("a", m, 0.0) == []


def test_receiver_view_failure_fails_its_transfer_with_sink_error() -> None:
    rx = rx_for(10, place=True)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    rx.place("a", DataHead(1, 0, 0, 10, 10, 0, 0, 0))
    outs = rx.place_failed("a", KVBridgeError("no view"), 0.0)
    (abort,) = replies(outs)
    assert isinstance(abort, Abort) and abort.code == ErrorCode.SINK_ERROR


def test_receiver_abort_from_the_sender_maps_its_code() -> None:
    rx = rx_for(10)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    assert rx.on_abort("a", Abort(2, ErrorCode.CANCELLED, "other id"), 0.0) == []
    (res,) = rx.on_abort("a", Abort(1, ErrorCode.SOURCE_ERROR, "disk"), 0.0)
    assert isinstance(res, Resolve) and isinstance(res.error, TransferAborted)
    assert res.error.code == ErrorCode.SOURCE_ERROR


def test_receiver_deadline_then_linger_then_forget() -> None:
    rx = rx_for(10, linger=5.0)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    assert rx.next_deadline == 100.0 and rx.poll(99.0) == []
    outs = rx.poll(100.0)
    assert isinstance(only(outs, Resolve)[0].error, TransferTimeout)  # type: ignore[attr-defined]
    (abort,) = replies(outs)
    assert isinstance(abort, Abort) and abort.code == ErrorCode.TIMEOUT
    assert rx.next_deadline == 105.0
    (late,) = replies(rx.on_open("b", open_msg(1, 10, 10), False, 104.0))
    assert isinstance(late, Abort) and late.code == ErrorCode.CANCELLED
    assert (
        rx.poll(105.0) == [Forget()] and rx.state is RxState.FORGOTTEN and rx.next_deadline is None
    )


def test_receiver_completed_transfer_replays_complete_on_any_connection_while_it_lingers() -> None:
    rx = rx_for(10, linger=5.0)
    rx.on_open("a", open_msg(1, 10, 10), False, 0.0)
    (w,) = only(rx.on_data("a", data(1, 10, 0, bytes(10)), 0.0), Write)
    rx.written(w.job, 0.0)  # type: ignore[attr-defined]
    rx.flushed(1.0)
    # again on the same connection (a ticket sent again), and on another one
    assert replies(rx.on_open("a", open_msg(2, 10, 10), False, 2.0)) == [
        Resume(2, ((0, 10),)), Complete(2, 10)
    ]  # fmt: skip
    assert replies(rx.on_open("b", open_msg(1, 10, 4), False, 3.0)) == [
        Resume(1, ((0, 10),)), Complete(1, 10)
    ]  # fmt: skip
    assert rx.poll(6.0) == [Forget()]


# ---- the receiver: byte ranges (issue 10 item 1) ----------------------------------------------
def test_receiver_later_open_may_change_the_chunk_size() -> None:
    rx = rx_for(100)
    payload = os.urandom(100)
    rx.on_open("a", open_msg(1, 100, 30), True, 0.0)
    for off in (0, 30):
        (w,) = only(rx.on_data("a", data(1, 30, off, payload[off : off + 30]), 0.0), Write)
        rx.written(w.job, 0.0)  # type: ignore[attr-defined]
    rx.conn_lost("a", 0.0)
    # a new sender, another chunk size: RESUME lists the exact bytes held
    assert replies(rx.on_open("b", open_msg(1, 100, 25), True, 0.0)) == [Resume(1, ((0, 60),))]
    # a connection without RANGES only hears of the whole chunks of its grid
    assert replies(rx.on_open("c", open_msg(1, 100, 25), False, 0.0)) == [Resume(1, ((0, 50),))]
    # the chunk [50, 75) on the plain connection: only [60, 75) is written
    (w,) = only(rx.on_data("c", data(1, 25, 50, payload[50:75]), 0.0), Write)
    assert w.pieces == ((60, 75),)  # type: ignore[attr-defined]
    assert replies(rx.written(w.job, 0.0), "c") == [Ack(1, ((50, 25),))]  # type: ignore[attr-defined]
    # a part of a chunk on the ranged connection
    (w,) = only(
        rx.on_data("b", Data(1, 3, 75, 25, 0, 0, checksum(payload[75:]), payload[75:]), 0.0), Write
    )
    assert w.pieces == ((75, 100),) and only(rx.written(w.job, 0.0), Flush)  # type: ignore[attr-defined]


def test_resumed_transfer_with_another_chunk_size_sends_only_what_is_missing() -> None:
    """A sender dies after 5 of 8 chunks of 1000 bytes; a new one, with
    chunks of 700, completes sending exactly the 3000 bytes that are missing."""
    size = 8000
    p = pair(size, 1000)
    p.connect("a")
    for _ in range(5):
        p.send_one("a")
    assert p.rx.received_bytes == 5000
    p.lose("a")  # the first sender is gone (killed)
    q = Pair(p.payload, tx_for(size), p.rx)
    q.dest, q.written = p.dest, p.written
    q.tx.start(700, 0.0)
    q.connect("b")
    q.run(["b"])
    assert q.tx_done == [None] and q.rx_done == [None]
    assert bytes(q.dest) == p.payload
    assert q.sent_bytes == size - 5000  # not one byte the receiver held


def test_repeated_transfer_with_another_chunk_size_on_a_plain_connection_completes() -> None:
    """Without RANGES a partly held chunk goes whole; the receiver writes only
    its missing bytes, and no byte is written twice."""
    size = 8000
    p = pair(size, 1000)
    p.connect("a", ranged=False)
    for _ in range(3):
        p.send_one("a")
    p.lose("a")
    q = Pair(p.payload, tx_for(size), p.rx)
    q.dest, q.written = p.dest, p.written
    q.tx.start(700, 0.0)
    q.connect("b", ranged=False)
    q.run(["b"])
    assert q.tx_done == [None] and bytes(q.dest) == p.payload


# ---- the sender ---------------------------------------------------------------------------
def test_sender_round_trip_striped() -> None:
    p = pair(10_000, 1000)
    p.connect("a")
    p.connect("b")
    p.run(["a", "b"])
    assert p.tx_done == [None] and p.rx_done == [None] and bytes(p.dest) == p.payload
    assert p.tx.state is TxState.DONE and p.tx.acked_bytes == 10_000 and p.tx.retries == 0


def test_sender_resume_after_a_lost_connection_sends_what_was_on_it_again() -> None:
    p = pair(10_000, 1000)
    p.connect("a")
    p.connect("b")
    p.drop = lambda f: f.transfer_id == p.tids.get("b") and f.offset in (1000, 3000)
    for _ in range(4):
        p.send_one("a" if _ % 2 == 0 else "b")
    p.drop = None
    p.lose("b")  # its two chunks never arrived: back in the queue
    assert p.tx.retries == 2
    p.run(["a"])
    assert p.tx_done == [None] and bytes(p.dest) == p.payload


def test_sender_resume_marks_what_the_receiver_holds() -> None:
    tx = tx_for(100)
    tx.start(10, 0.0)
    tx.attach("a", 1)
    assert tx.on_message("a", Resume(1, ((0, 30), (50, 10))), 0.0) == [Wake()]
    assert tx.acked_bytes == 40
    sent = []
    while tx.has_pending():
        sent.append(tx.pop_pending())
    assert sent == [3, 4, 6, 7, 8, 9]


def test_sender_sends_at_most_early_bytes_before_the_first_resume() -> None:
    """Before RESUME says what the receiver holds, only ``early_bytes`` of
    chunks may go (a transfer sent again repeats at most that much); the
    first RESUME, on any connection, lets the rest go, and only what is missing."""
    tx = tx_for(100)
    tx.start(10, 0.0, early_bytes=25)
    tx.attach("a", 1)
    tx.attach("b", 1)
    sent = []
    while tx.has_pending():
        idx = tx.pop_pending()
        tx.claim("a", idx)
        sent.append(idx)
    assert sent == [0, 1, 2]  # 30 bytes claimed: the third crossed the budget
    # a second RESUME is not a new "go": only the first one wakes
    assert tx.on_message("b", Resume(1, ((0, 20), (40, 60))), 0.0) == [Wake()]
    assert tx.on_message("a", Resume(1, ((0, 20),)), 0.0) == []
    rest = []
    while tx.has_pending():
        rest.append(tx.pop_pending())
    assert rest == [3]  # held: 0-1 and 4-9; chunk 2 is still on its way on "a"


def test_sender_early_bytes_none_is_no_limit_and_one_chunk_always_goes() -> None:
    tx = tx_for(100)
    tx.start(10, 0.0)
    n = 0
    while tx.has_pending():
        tx.claim("a", tx.pop_pending())
        n += 1
    assert n == 10
    tx = tx_for(100)
    tx.start(40, 0.0, early_bytes=0)
    assert not tx.has_pending()  # nothing before RESUME with a zero budget
    tx.attach("a", 1)
    assert tx.on_message("a", Resume(1, ()), 0.0) == [Wake()]
    assert tx.has_pending()


@pytest.mark.parametrize(
    "bad",
    [Ack(1, ((0, 200),)), Ack(1, ((-1, 5),)), Ack(1, ((10, 0),)), Nack(1, 200, 10, 15),
     Complete(1, 99)],
)  # fmt: skip
def test_sender_replies_outside_the_transfer_are_protocol_errors(bad: Message) -> None:
    tx = tx_for(100)
    tx.start(10, 0.0)
    tx.attach("a", 1)
    with pytest.raises(RemoteProtocolError):
        tx.on_message("a", bad, 0.0)  # type: ignore[arg-type]


def test_sender_nack_resends_then_gives_up_with_checksum() -> None:
    tx = tx_for(10, max_resends=2)
    tx.start(10, 0.0)
    tx.attach("a", 1)
    for i in range(3):
        idx = tx.pop_pending()
        tx.claim("a", idx)
        tx.sent("a", idx, 1, 0.0)
        outs = tx.on_message("a", Nack(1, 0, 10, ErrorCode.CHECKSUM), 0.0)
        if i < 2:
            assert outs == [Wake()] and tx.has_pending()
    assert isinstance(outs[0], SendAbort) and outs[0].message.code == ErrorCode.CHECKSUM
    assert isinstance(outs[-1], Finished) and isinstance(outs[-1].error, ChecksumError)


def test_sender_damaged_chunks_are_resent_never_delivered() -> None:
    p = pair(6000, 1000)
    p.connect("a")
    hits = {2000, 4000}
    p.damage = lambda f: f.offset in hits and not hits.discard(f.offset)
    p.run(["a"])
    assert p.tx_done == [None] and bytes(p.dest) == p.payload
    assert p.rx.bad_chunks == 2 and p.tx.retries == 2


def test_sender_abort_from_the_receiver_ends_it_with_the_mapped_error() -> None:
    for code, cls in [(ErrorCode.UNKNOWN_TOKEN, AuthenticationError), (ErrorCode.TRANSFER_MISMATCH,
                      IncompatiblePeer), (ErrorCode.TIMEOUT, TransferTimeout),
                      (ErrorCode.CANCELLED, TransferAborted)]:  # fmt: skip
        tx = tx_for(10)
        tx.start(10, 0.0)
        tx.attach("a", 1)
        (fin,) = tx.on_message("a", Abort(1, code, "why"), 0.0)
        assert isinstance(fin, Finished) and type(fin.error) is cls


def test_sender_cancel_aborts_on_every_opened_connection() -> None:
    tx = tx_for(10)
    tx.start(10, 0.0)
    tx.attach("a", 1)
    tx.attach("b", 5)
    outs = tx.cancel(Cancelled("engine"), ErrorCode.CANCELLED)
    assert {(o.link, o.message.transfer_id) for o in outs if isinstance(o, SendAbort)} == {
        ("a", 1),
        ("b", 5),
    }
    assert isinstance(outs[-1], Finished) and tx.unopened_abort is None


def test_sender_cancel_before_the_first_open_owes_open_and_abort() -> None:
    tx = tx_for(10)
    outs = tx.cancel(Cancelled("engine"), ErrorCode.CANCELLED)
    assert outs[0] == AbortUnopened(ErrorCode.CANCELLED, "engine")
    assert tx.unopened_abort == (ErrorCode.CANCELLED, "engine")
    assert tx.open_message(3, 7).chunk_size > 0  # a valid OPEN to abort


def test_sender_a_completed_transfer_sent_again_completes_without_bytes() -> None:
    p = pair(3000, 1000)
    p.connect("a")
    p.run(["a"])
    q = Pair(p.payload, tx_for(3000), p.rx)
    q.tx.start(1000, 0.0)
    q.connect("a")
    q.tids["a"] = 7  # the same connection, a new id
    q.open("a")
    assert q.tx_done == [None] and q.sent == []


def test_sender_deadline_is_typed_and_aborts() -> None:
    tx = tx_for(10)
    tx.start(10, 0.0)
    tx.attach("a", 1)
    tx.links_changed(1, 0.0)
    assert tx.poll(99.0) == []
    outs = tx.poll(100.0)
    assert outs[0] == SendAbort("a", Abort(1, ErrorCode.TIMEOUT, outs[0].message.reason))  # type: ignore[union-attr]
    assert isinstance(outs[-1], Finished) and isinstance(outs[-1].error, TransferTimeout)
    assert "after 100 s" in str(outs[-1].error)


# ---- the sender's ack timer (issue 10 item 2) --------------------------------------------------
def test_a_silently_dropped_chunk_is_resent_after_the_ack_timer() -> None:
    p = pair(8000, 1000, clock=AckClock(0.5))
    p.connect("a")
    lost = {3000}
    p.drop = lambda f: f.offset in lost and not lost.discard(f.offset)
    p.run(["a"], step=0.1)
    assert p.tx_done == [None] and bytes(p.dest) == p.payload
    assert p.tx.retries == 1 and p.now <= 2.0  # resent after about 0.5 s (the floor)


def test_ack_timer_adapts_and_backs_off_per_chunk() -> None:
    clock = AckClock(0.1)
    assert clock.rto == 0.2  # before any measurement
    for _ in range(20):
        clock.observe(1.0)
    assert 1.0 <= clock.rto < 1.5
    tx = tx_for(10, clock=clock)
    tx.start(10, 0.0)
    tx.attach("a", 1)
    deadlines = []
    now = 0.0
    for _ in range(3):
        idx = tx.pop_pending()
        tx.claim("a", idx)
        tx.sent("a", idx, 1, now)
        deadlines.append(tx.next_deadline - now)  # type: ignore[operator]
        now = tx.next_deadline  # type: ignore[assignment]
        assert tx.poll(now) == [Wake()]
    assert deadlines[1] == pytest.approx(2 * deadlines[0]) and deadlines[2] == pytest.approx(
        4 * deadlines[0]
    )
    assert tx.retries == 3


def test_a_late_ack_after_a_resend_is_not_a_sample() -> None:
    clock = AckClock(1.0)
    tx = tx_for(10, clock=clock)
    tx.start(10, 0.0)
    tx.attach("a", 1)
    idx = tx.pop_pending()
    tx.claim("a", idx)
    tx.sent("a", idx, 1, 0.0)
    assert tx.poll(5.0) == [Wake()]  # timed out: sent again
    idx = tx.pop_pending()
    tx.claim("a", idx)
    tx.sent("a", idx, 1, 5.0)
    tx.on_message("a", Ack(1, ((0, 10),)), 5.1)
    assert clock.srtt is None  # Karn: a resent chunk's ACK measures nothing


# ---- the reconnect clock (issue 10 item 3) ------------------------------------------------------
def test_reconnect_timeout_counts_from_the_last_lost_connection() -> None:
    tx = tx_for(10, reconnect_timeout=20.0)
    tx.start(10, 0.0)
    tx.links_changed(4, 0.0)
    tx.links_changed(3, 0.0)  # one link lost at t=0
    assert tx.poll(19.0) == [] and tx.poll(21.0) == []  # three still carry it
    tx.links_changed(0, 15.0)  # the other three at t=15
    assert tx.poll(34.9) == []
    (fin,) = tx.poll(35.0)
    assert isinstance(fin, Finished) and isinstance(fin.error, PeerGone)


def test_a_connection_back_in_time_stops_the_reconnect_clock() -> None:
    tx = tx_for(10, reconnect_timeout=5.0)
    tx.start(10, 0.0)
    tx.links_changed(0, 1.0)
    tx.links_changed(1, 5.0)
    tx.links_changed(0, 8.0)
    assert tx.poll(12.9) == [] and tx.next_deadline == 13.0


# ---- layer-wise readiness (issue 11) ----------------------------------------------------------
def test_chunks_whose_bytes_are_not_ready_are_not_offered() -> None:
    tx = TxTransfer("req", TOKEN, 100, deadline=100.0, now=0.0, clock=AckClock(1.0),
                    limits=TxLimits(ready_timeout=3.0), ready_bytes=0)  # fmt: skip
    tx.start(10, 0.0)
    assert not tx.has_pending()
    assert tx.set_ready(25, 1.0) == [Wake()]
    assert [tx.pop_pending(), tx.pop_pending()] == [0, 1] and not tx.has_pending()
    assert tx.next_deadline == 4.0  # waiting for bytes from 25 since t=1
    (owed, fin) = tx.poll(4.0)
    assert owed == AbortUnopened(ErrorCode.TIMEOUT, str(fin.error))  # type: ignore[union-attr]
    assert isinstance(fin, Finished) and isinstance(fin.error, TransferTimeout)


def _linked(clock: AckClock, links: dict[str, LinkClock]) -> TxTransfer[str]:
    tx = TxTransfer("req", TOKEN, 100, deadline=100.0, now=0.0, clock=clock,
                    link_clock=links.__getitem__)  # fmt: skip
    tx.start(10, 0.0)
    tx.attach("a", 1)
    tx.links_changed(1, 0.0)
    return tx


def _send(tx: TxTransfer[str], now: float) -> int:
    idx = tx.pop_pending()
    tx.claim("a", idx)
    tx.sent("a", idx, 1, now, 10)
    return idx


def test_a_chunk_queued_behind_others_on_a_slow_link_is_not_taken_for_lost() -> None:
    """While its connection keeps replying, a chunk waits as long as it must;
    the connection's stall time is rate-aware (4 chunk times)."""
    lc = LinkClock(0.0)
    tx = _linked(AckClock(0.1), {"a": lc})
    other = _Flight("a")  # another transfer's chunk, ahead on the link
    lc.on_send(other, 10)
    _send(tx, 0.0)
    assert tx.next_deadline == pytest.approx(20.0)  # the rate is unknown yet: 20 s
    other.done = True
    lc.on_reply(10, 5.0)  # 10 bytes in 5 s: 2 B/s; 4 chunk times = 20 s
    assert lc.rate == pytest.approx(2.0)
    assert tx.poll(20.0) == [] and tx.next_deadline == pytest.approx(25.0)
    assert tx.poll(25.0) == [Wake()] and tx.retries == 1  # silent for 4 chunk times: lost


def test_a_chunk_overtaken_on_its_link_is_resent_even_while_the_link_replies() -> None:
    """A chunk the receiver dropped while later chunks on the same connection
    are acknowledged (more bytes acknowledged there than were sent ahead of
    it): resent rto after it was overtaken, however busy the link stays."""
    lc = LinkClock(0.0)
    clock = AckClock(0.5)
    tx = _linked(clock, {"a": lc})
    first = _send(tx, 0.0)
    _send(tx, 0.0)
    tx.on_message("a", Ack(1, ((10, 10),)), 0.2)  # chunk 1 acknowledged, chunk 0 not
    lc.on_reply(10, 0.2)
    for t in (0.3, 0.5, 0.7):
        lc.on_reply(0, t)  # the link keeps replying (other traffic)
    assert first in tx.inflight and tx.next_deadline == pytest.approx(0.2 + clock.rto)
    assert tx.poll(0.2 + clock.rto) == [Wake()] and tx.retries == 1


# ---- one live source per transfer (issue 28; docs/protocol.md 5.1) ---------------------------
def _conflict(outs: list[object]) -> bool:
    msgs = replies(outs)
    return len(msgs) == 1 and isinstance(msgs[0], Abort) and msgs[0].code == 17


def test_another_live_source_is_refused_and_the_first_one_completes() -> None:
    rx = rx_for(20)
    a, b = bytes(range(20)), bytes(range(100, 120))
    assert replies(rx.on_open("a1", open_msg(1, 20, 10), True, 0.0, "A")) == [Resume(1, ())]
    (w,) = only(rx.on_data("a1", data(1, 10, 0, a[:10]), 0.0), Write)
    # a second sender, same token and range, another source: refused, the transfer goes on
    outs = rx.on_open("b1", open_msg(1, 20, 10), True, 0.0, "B")
    assert _conflict(outs) and rx.running and "b1" not in rx.attached
    assert ErrorCode.SOURCE_CONFLICT == 17 and rx.conflicts == 1 and rx.source == "A"
    # its pipelined DATA is not the transfer's (the driver drops it as stray)
    assert rx.on_data("b1", data(1, 10, 10, b[10:]), 0.0) == []
    # more connections of the bound source attach (striping)
    assert replies(rx.on_open("a2", open_msg(4, 20, 10), True, 0.0, "A")) == [Resume(4, ())]
    rx.written(w.job, 0.0)  # type: ignore[attr-defined]
    (w,) = only(rx.on_data("a2", data(4, 10, 10, a[10:]), 0.0), Write)
    assert w.data.data == a[10:]  # type: ignore[attr-defined]
    assert only(rx.written(w.job, 0.0), Flush)  # type: ignore[attr-defined]
    rx.flushed(0.0)
    # while it lingers with the bound source attached, another source is refused still
    assert _conflict(rx.on_open("b1", open_msg(2, 20, 10), True, 1.0, "B"))


def test_a_source_whose_connections_all_closed_is_taken_over_keeping_what_is_held() -> None:
    rx = rx_for(30)
    kv = os.urandom(30)
    rx.on_open("a1", open_msg(1, 30, 10), True, 0.0, "A")
    rx.on_open("a2", open_msg(1, 30, 10), True, 0.0, "A")
    (w,) = only(rx.on_data("a1", data(1, 10, 0, kv[:10]), 0.0), Write)
    rx.written(w.job, 0.0)  # type: ignore[attr-defined]
    rx.conn_lost("a1", 1.0)
    # one connection of A is still attached: A is live
    assert _conflict(rx.on_open("b1", open_msg(1, 30, 10), True, 1.0, "B"))
    rx.conn_lost("a2", 2.0)
    # A is gone: B takes over; RESUME lists what A delivered
    assert replies(rx.on_open("b1", open_msg(2, 30, 10), True, 2.0, "B")) == [Resume(2, ((0, 10),))]
    assert rx.source == "B" and rx.takeovers == 1
    # now A, back, is the other source and B is live
    assert _conflict(rx.on_open("a3", open_msg(1, 30, 10), True, 2.0, "A"))
    for off in (10, 20):
        (w,) = only(rx.on_data("b1", data(2, 10, off, kv[off : off + 10]), 2.0), Write)
        rx.written(w.job, 2.0)  # type: ignore[attr-defined]
    assert rx.state is RxState.FLUSHING


def test_the_same_source_resumes_after_losing_every_connection() -> None:
    p = pair(40, 10)
    p.connect("a")
    p.send_one("a")
    p.lose("a")
    assert not p.rx.attached and p.rx.bound
    p.connect("b")
    p.run(["b"])
    assert p.tx_done == [None] and p.rx_done == [None] and bytes(p.dest) == p.payload
    assert p.rx.takeovers == 0 and p.rx.conflicts == 0


def test_a_refused_source_cannot_abort_the_transfer() -> None:
    rx = rx_for(20)
    rx.on_open("a", open_msg(1, 20, 10), True, 0.0, "A")
    assert _conflict(rx.on_open("b", open_msg(1, 20, 10), True, 0.0, "B"))
    assert rx.on_abort("b", Abort(1, ErrorCode.CANCELLED, "x"), 0.0) == [] and rx.running


def test_a_failed_transfer_answers_cancelled_before_any_conflict() -> None:
    rx = rx_for(20)
    rx.on_open("a", open_msg(1, 20, 10), True, 0.0, "A")
    rx.cancel(Cancelled("x"), ErrorCode.CANCELLED, 0.0)
    (m,) = replies(rx.on_open("b", open_msg(1, 20, 10), True, 0.0, "B"))
    assert isinstance(m, Abort) and m.code == ErrorCode.CANCELLED


def test_a_mismatched_open_of_another_source_is_a_mismatch_first() -> None:
    rx = rx_for(20)
    rx.on_open("a", open_msg(1, 20, 10, (0, 5, 0, 2)), True, 0.0, "A")
    (m,) = replies(rx.on_open("b", open_msg(1, 20, 10, (0, 6, 0, 2)), True, 0.0, "B"))
    assert isinstance(m, Abort) and m.code == ErrorCode.TRANSFER_MISMATCH


def test_the_sender_maps_source_conflict_and_names_its_source_in_every_open() -> None:
    tx = TxTransfer(
        "req", TOKEN, 20, deadline=100.0, now=0.0, clock=AckClock(1.0), source_id=b"S" * 16
    )
    tx.start(10, 0.0)
    tx.attach("a", 1)
    assert tx.open_message(1, 7).source == b"S" * 16
    (fin,) = tx.on_message("a", Abort(1, ErrorCode.SOURCE_CONFLICT, "another"), 0.0)
    assert isinstance(fin, Finished) and isinstance(fin.error, SourceConflict)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["open", "data", "lose"]), st.integers(0, 5), st.integers(0, 4)),
        max_size=60,
    )
)
def test_property_one_live_source_writes_and_takeover_only_when_gone(
    ops: list[tuple[str, int, int]],
) -> None:
    """Three senders (sources 0-2, two connections each) with different
    bytes open, send chunks and lose connections in any order: every
    attached connection is the bound source's; an OPEN is refused exactly
    while another source is attached; every byte written came from the source
    bound at that moment, so with no takeover the destination is only the
    first source's bytes."""
    total, chunk = 50, 10
    kv = [bytes([s * 50 + i for i in range(total)]) for s in range(3)]
    rx = rx_for(total)
    dest = bytearray(total)
    origin = [-1] * total  # which source each byte came from
    tids: dict[int, int] = {}
    live: set[int] = set()
    for op, conn, k in ops:
        src = conn // 2
        if op == "open" and conn not in live:
            tids[conn] = tids.get(conn, 0) + 1
            others = {c // 2 for c in rx.attached} - {src}
            outs = rx.on_open(conn, open_msg(tids[conn], total, chunk), True, 0.0, src)
            live.add(conn)
            if others:
                assert _conflict(outs) and conn not in rx.attached
            else:
                assert conn in rx.attached and rx.source == src
        elif op == "data" and conn in live:
            off = k * chunk
            for o in rx.on_data(
                conn, data(tids[conn], chunk, off, kv[src][off : off + chunk]), 0.0
            ):
                if isinstance(o, Write):
                    assert conn in rx.attached and rx.source == src
                    for a, b in o.pieces:
                        dest[a:b] = bytes(o.data.data)[a - off : b - off]
                        origin[a:b] = [src] * (b - a)
                    rx.written(o.job, 0.0)
        elif op == "lose" and conn in live:
            live.discard(conn)
            rx.conn_lost(conn, 0.0)
        assert {c // 2 for c in rx.attached} <= {rx.source}
    if rx.takeovers == 0:
        assert len({o for o in origin if o >= 0}) <= 1
    for i, o in enumerate(origin):
        if o >= 0:
            assert dest[i] == kv[o][i]
