"""The rules of one TCP connection without sockets, threads or an event loop:
the sans-IO machines of kvbridge.wire.connection fed decoded frames and the
time (as tests/test_transfer_machines.py does for the transfer machines).

Keepalive (docs/protocol.md 4.5, 4.6), the receiver's connection rules
(which frames a sender may send, transfer ids, the unknown-token budget that
ends in AUTH_FAILED, the transfer limit, stray DATA: 3, 5, 5.1, 5.3 step 1,
10) and the sender's (fresh ids, what a receiver may send, replies for ids
it no longer knows)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import (
    AuthenticationError,
    ErrorCode,
    IncompatiblePeer,
    PeerGone,
    RemoteProtocolError,
    code_for_error,
)
from kvbridge.wire.connection import (
    FROM_RECEIVER,
    FROM_SENDER,
    Admit,
    Close,
    ConnLimits,
    Deliver,
    Keepalive,
    RxConnection,
    Send,
    ToControl,
    TxConnection,
)
from kvbridge.wire.frames import (
    Abort,
    Ack,
    Auth,
    Complete,
    Control,
    Data,
    Error,
    Hello,
    HelloAck,
    Message,
    Nack,
    Open,
    Ping,
    Pong,
    Ready,
    Resume,
)

TOKEN, OTHER = b"T" * 16, b"U" * 16


def open_msg(tid: int, token: bytes = TOKEN) -> Open:
    return Open(tid, token, 0, 20, 10, 0, 0, 0, 0, 7, 0, "req")


def data(tid: int, *, placed: bool = False) -> Data:
    return Data(tid, 0, 0, 4, 0, 0, 0, b"abcd", placed=placed)


ALL: list[Message] = [
    Hello(1, 1, 0, 0, 4096, 0, bytes(32), "x"),
    HelloAck(1, 0, 0, 4096, 0, bytes(32), bytes(32), "y"),
    Auth(bytes(32)),
    Ready(),
    open_msg(1),
    Resume(1, ()),
    data(1),
    Ack(1, ((0, 4),)),
    Nack(1, 0, 4, ErrorCode.CHECKSUM),
    Abort(1, ErrorCode.CANCELLED, "x"),
    Complete(1, 20),
    Control(0x41, 0, b"\x01"),
]


# ---- keepalive --------------------------------------------------------------------------------
def test_keepalive_pings_when_idle_and_closes_when_the_peer_is_silent() -> None:
    ka = Keepalive(5.0, 20.0, 0.0)
    assert ka.next_deadline == 5.0 and ka.poll(4.9) == []
    (ping,) = ka.poll(5.0)
    assert isinstance(ping, Send) and isinstance(ping.message, Ping)
    ka.sent(5.0)
    assert ka.next_deadline == 10.0
    (again,) = ka.poll(10.0)
    assert isinstance(again, Send) and again.message != ping.message  # a fresh nonce
    ka.sent(10.0)
    ka.received(12.0)  # any byte from the peer counts
    assert ka.next_deadline == 15.0
    for t in (15.0, 20.0, 25.0, 30.0):
        assert ka.poll(t) and isinstance(ka.poll(t)[0], Send)
        ka.sent(t)
    (gone,) = ka.poll(32.0)  # 20 s since the peer's last byte
    assert isinstance(gone, Close) and isinstance(gone.error, PeerGone)
    assert not gone.send_error and "keepalive" in str(gone.error)


def test_keepalive_answers_ping_drops_pong_and_an_error_ends_the_connection() -> None:
    assert Keepalive.receive(Ping(42)) == [Send(Pong(42))]
    assert Keepalive.receive(Pong(42)) == []
    (c,) = Keepalive.receive(Error(ErrorCode.INCOMPATIBLE_LAYOUT, "layout"))  # type: ignore[misc]
    assert isinstance(c, Close) and isinstance(c.error, IncompatiblePeer) and not c.send_error
    (c,) = Keepalive.receive(Error(ErrorCode.UNKNOWN_TOKEN, "t"))  # type: ignore[misc]
    assert isinstance(c, Close) and isinstance(c.error, AuthenticationError)
    for m in ALL:
        assert Keepalive.receive(m) is None  # not a keepalive matter


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.5, 10.0),
    st.floats(1.0, 40.0),
    st.lists(st.tuples(st.floats(0.0, 8.0), st.sampled_from(["rx", "tx", "none"])), max_size=80),
)
def test_property_keepalive_closes_exactly_when_silent_and_pings_only_when_idle(
    interval: float, timeout: float, steps: list[tuple[float, str]]
) -> None:
    """A driver that sleeps until next_deadline (or until a read or write,
    whichever comes first), polls and carries out the result: it closes
    exactly when the peer has been silent for ``timeout``, sends a PING only
    when it sent nothing for ``interval``, and never sleeps past a due PING."""
    ka = Keepalive(interval, timeout, 0.0)
    now, nonces = 0.0, set()
    for dt, event in steps:
        t = min(now + dt, ka.next_deadline)  # the timer fires first, or the event comes
        assert t >= now
        now = t
        outs = ka.poll(now)
        if now >= ka.last_rx + timeout:
            assert len(outs) == 1 and isinstance(outs[0], Close)
            return
        if now >= ka.last_tx + interval:
            (o,) = outs
            assert isinstance(o, Send) and isinstance(o.message, Ping)
            assert o.message.nonce not in nonces
            nonces.add(o.message.nonce)
            ka.sent(now)
        else:
            assert outs == []
        if event == "rx":
            ka.received(now)
        elif event == "tx":
            ka.sent(now)
        assert ka.next_deadline > now  # nothing is overdue after polling


# ---- the receiver's connection ----------------------------------------------------------------
def rx_conn(**lim: int) -> RxConnection[str]:
    return RxConnection(ConnLimits(**lim))


def find(token: bytes) -> str | None:
    return "t" if token == TOKEN else None


@pytest.mark.parametrize("m", [m for m in ALL if not isinstance(m, FROM_SENDER)])
def test_receiver_refuses_frames_a_sender_may_not_send(m: Message) -> None:
    (c,) = rx_conn().receive(m, find)
    assert isinstance(c, Close) and isinstance(c.error, RemoteProtocolError) and c.send_error
    assert type(m).__name__ in str(c.error)
    assert code_for_error(c.error) == ErrorCode.PROTOCOL_ERROR


def test_receiver_admits_an_open_and_delivers_its_frames() -> None:
    rc = rx_conn()
    m = open_msg(3)
    assert rc.receive(m, find) == [Admit("t", m)]
    rc.attached(3, "t", finished=False)
    d, a = data(3), Abort(3, ErrorCode.CANCELLED, "x")
    assert rc.receive(d, find) == [Deliver("t", d)]
    assert rc.receive(a, find) == [Deliver("t", a)]
    assert rc.receive(Abort(4, ErrorCode.CANCELLED, "x"), find) == []  # names nothing here
    c = Control(0x41, 0, b"x")
    assert rc.receive(c, find) == [ToControl(c)]
    assert rc.transfer(3) == "t" and rc.transfer(4) is None


def test_receiver_a_reused_transfer_id_closes_the_connection() -> None:
    rc = rx_conn()
    rc.receive(open_msg(1), find)
    rc.attached(1, "t", finished=False)
    (c,) = rc.receive(open_msg(1), find)
    assert isinstance(c, Close) and isinstance(c.error, RemoteProtocolError)
    assert "reused" in str(c.error)
    rc.forget(1, "t")  # forgotten (the linger ended): the id names nothing any more
    assert rc.receive(open_msg(1), find) == [Admit("t", open_msg(1))]


def test_receiver_unknown_tokens_are_aborted_then_the_ninth_is_auth_failed() -> None:
    rc = rx_conn()
    for i in range(8):
        assert rc.receive(open_msg(i + 1, OTHER), find) == [
            Send(Abort(i + 1, ErrorCode.UNKNOWN_TOKEN, "transfer token not issued"))
        ]
    abort, close = rc.receive(open_msg(9, OTHER), find)
    assert isinstance(abort, Send) and abort.message.code == ErrorCode.UNKNOWN_TOKEN  # type: ignore[union-attr]
    assert isinstance(close, Close) and isinstance(close.error, AuthenticationError)
    assert code_for_error(close.error) == ErrorCode.AUTH_FAILED and rc.unknown_tokens == 9


def test_receiver_transfer_limit_counts_open_transfers_not_lingering_ones() -> None:
    rc = rx_conn(max_transfers=2)
    for tid in (1, 2):
        rc.receive(open_msg(tid), find)
        rc.attached(tid, "t", finished=False)
    assert rc.receive(open_msg(3), find) == [
        Send(Abort(3, ErrorCode.RESOURCE_LIMIT, "too many open transfers"))
    ]
    rc.lingers(1, "t")  # finished: it lingers, no longer open
    assert rc.open_transfers == 1
    assert rc.receive(open_msg(4), find) == [Admit("t", open_msg(4))]
    rc.attached(4, "t", finished=True)  # a late OPEN of a finished transfer lingers at once
    assert rc.open_transfers == 1


def test_receiver_stray_data_is_dropped_and_counted_then_closes() -> None:
    rc = rx_conn(max_stray_frames=3)
    assert rc.receive(data(5, placed=True), find) == []  # placed: not counted
    for _ in range(3):
        assert rc.receive(data(5), find) == []
    (c,) = rc.receive(data(5), find)
    assert isinstance(c, Close) and isinstance(c.error, RemoteProtocolError)
    assert rc.stray == 4


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["open", "open_unknown", "data", "placed", "abort", "linger", "forget"]
            ),
            st.integers(1, 6),
            st.booleans(),
        ),
        max_size=60,
    )
)
def test_property_receiver_connection_rules(ops: list[tuple[str, int, bool]]) -> None:
    """Any sequence of frames and transfer events: frames are delivered only
    for ids open here; an id is admitted only while not in use and while
    fewer than the limit are open; the connection closes on the first
    reused id, on the unknown token past the budget (after its ABORT, with
    AUTH_FAILED) and on the stray DATA frame past the limit, and at no other
    time."""
    rc = rx_conn(max_transfers=3, max_unknown_tokens=2, max_stray_frames=4)
    tokens = {"t1": b"1" * 16, "t2": b"2" * 16}
    by_token = {v: k for k, v in tokens.items()}
    unknown = stray = 0
    for op, tid, coin in ops:
        before = dict(rc.transfers)
        opened = rc.open_transfers
        if op in ("open", "open_unknown"):
            token = (tokens["t1"] if coin else tokens["t2"]) if op == "open" else OTHER
            outs = rc.receive(open_msg(tid, token), by_token.get)
            if tid in before:
                assert len(outs) == 1 and isinstance(outs[0], Close)
                assert "reused" in str(outs[0].error)
                return
            if op == "open_unknown":
                unknown += 1
                assert isinstance(outs[0], Send) and outs[0].message.code == ErrorCode.UNKNOWN_TOKEN  # type: ignore[union-attr]
                if unknown > 2:
                    assert isinstance(outs[-1], Close)
                    assert isinstance(outs[-1].error, AuthenticationError)
                    return
                assert len(outs) == 1
            elif opened >= 3:
                assert outs == [
                    Send(Abort(tid, ErrorCode.RESOURCE_LIMIT, "too many open transfers"))
                ]
            else:
                (a,) = outs
                assert isinstance(a, Admit) and a.transfer == by_token[token]
                rc.attached(tid, a.transfer, finished=False)
        elif op in ("data", "placed"):
            outs = rc.receive(data(tid, placed=op == "placed"), by_token.get)
            if tid in before:
                assert outs == [Deliver(before[tid], data(tid, placed=op == "placed"))]
            elif op == "placed":
                assert outs == []
            else:
                stray += 1
                if stray > 4:
                    assert len(outs) == 1 and isinstance(outs[0], Close)
                    return
                assert outs == []
        elif op == "abort":
            outs = rc.receive(Abort(tid, ErrorCode.CANCELLED, "x"), by_token.get)
            assert (outs != []) == (tid in before)
        elif op == "linger" and tid in before:
            rc.lingers(tid, before[tid])
        elif op == "forget" and tid in before:
            rc.forget(tid, before[tid])
            assert rc.transfer(tid) is None
        assert rc.open_transfers <= 3 and rc.done <= set(rc.transfers)


# ---- the sender's connection ------------------------------------------------------------------
@pytest.mark.parametrize("m", [m for m in ALL if not isinstance(m, FROM_RECEIVER)])
def test_sender_refuses_frames_a_receiver_may_not_send(m: Message) -> None:
    (c,) = TxConnection[str]().receive(m)
    assert isinstance(c, Close) and isinstance(c.error, RemoteProtocolError)
    assert type(m).__name__ in str(c.error)


def test_sender_ids_are_fresh_and_replies_go_to_the_transfer_they_name() -> None:
    tc: TxConnection[str] = TxConnection()
    a, b = tc.open("a"), tc.open("b")
    spare = tc.new_tid()  # an OPEN + ABORT of a transfer cancelled before it began
    assert len({a, b, spare}) == 3
    for m in (Ack(a, ((0, 4),)), Resume(a, ()), Nack(a, 0, 4, 15), Complete(a, 20)):
        assert tc.receive(m) == [Deliver("a", m)]
    assert tc.receive(Abort(b, 9, "x")) == [Deliver("b", Abort(b, 9, "x"))]
    assert tc.receive(Complete(spare, 20)) == []  # an id it no longer knows: dropped
    tc.forget(a)
    assert tc.receive(Complete(a, 20)) == []  # a second COMPLETE
    c = Control(0x60, 0, b"")
    assert tc.receive(c) == [ToControl(c)]
    tc.clear()  # the connection is gone
    assert tc.receive(Ack(b, ((0, 4),))) == [] and tc.open("c") not in (a, b, spare)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["open", "spare", "forget", "clear"]), max_size=80))
def test_property_sender_never_reuses_an_id(ops: list[str]) -> None:
    tc: TxConnection[int] = TxConnection()
    used: set[int] = set()
    for i, op in enumerate(ops):
        if op in ("open", "spare"):
            tid = tc.open(i) if op == "open" else tc.new_tid()
            assert tid not in used
            used.add(tid)
        elif op == "forget" and tc.transfers:
            tc.forget(next(iter(tc.transfers)))
        elif op == "clear":
            tc.clear()
        for tid, t in tc.transfers.items():
            assert tc.receive(Ack(tid, ((0, 1),))) == [Deliver(t, Ack(tid, ((0, 1),)))]
