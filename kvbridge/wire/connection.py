"""The rules of one TCP connection, sans-IO (docs/protocol.md 3, 4.5, 4.6, 5, 10).

Where :class:`~kvbridge.wire.rxtransfer.RxTransfer` and
:class:`~kvbridge.wire.txtransfer.TxTransfer` hold the rules of one transfer,
these hold the rules whose scope is one connection, like h11's connection
state machine:

* :class:`Keepalive`: PING when we sent nothing for ``interval``, the peer
  gone when it sent nothing for ``timeout`` (4.6); PING answered with PONG,
  ERROR ends the connection (4.5), at any time, the handshake included.
* :class:`RxConnection`: a receiver's connection after READY: which frames a
  sender may send (3), transfer ids never reused on a connection (5), the
  budget of unknown tokens that ends in AUTH_FAILED (5.1), the limit of
  transfers open on one connection (10), DATA for transfers not open here
  dropped and counted (5.3 step 1), and which transfer each id names.
* :class:`TxConnection`: a sender's connection after READY: which frames a
  receiver may send (3), fresh transfer ids, which transfer a reply names
  (replies for ids it no longer knows are ignored, 5.7).

Each takes decoded messages (and the time) and returns outputs for the
driver to carry out (:class:`Send`, :class:`Close`, :class:`Deliver`,
:class:`Admit`, :class:`ToControl`); none touches a socket, a thread or an
event loop.  Transfers are opaque values of the driver's (``T``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import (
    AuthenticationError,
    ErrorCode,
    KVBridgeError,
    PeerGone,
    RemoteProtocolError,
    error_for_code,
)
from .frames import (
    Abort,
    Ack,
    Complete,
    Control,
    Data,
    Error,
    Message,
    Nack,
    Open,
    Ping,
    Pong,
    Resume,
)

__all__ = [
    "FROM_RECEIVER",
    "FROM_SENDER",
    "REPLIES",
    "Admit",
    "Close",
    "ConnLimits",
    "ConnOutput",
    "Deliver",
    "Keepalive",
    "RxConnection",
    "Send",
    "ToControl",
    "TxConnection",
]

T = TypeVar("T")

# the frames each side may send once the handshake is done (section 3), besides
# PING, PONG and ERROR, which either side may send at any time (Keepalive)
FROM_SENDER = (Open, Data, Abort, Control)
FROM_RECEIVER = (Resume, Ack, Nack, Abort, Complete, Control)
REPLIES = (Ack, Resume, Nack, Abort, Complete)  # a receiver's frames about one transfer


# ---- outputs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """Send ``message`` on this connection."""

    message: Message


@dataclass(frozen=True)
class Close:
    """Close the connection because of ``error``; first tell the peer with an
    ERROR frame of ``code_for_error(error)`` when ``send_error``."""

    error: KVBridgeError
    send_error: bool = True


@dataclass(frozen=True)
class Deliver(Generic[T]):
    """``message`` (DATA or ABORT from a sender; ACK, RESUME, NACK, ABORT or
    COMPLETE from a receiver) is for ``transfer``: hand it to its state machine."""

    transfer: T
    message: Message


@dataclass(frozen=True)
class Admit(Generic[T]):
    """An OPEN that the connection's rules let through, for ``transfer`` (the
    token's): hand it to the transfer's state machine, then report with
    :meth:`RxConnection.attached` whether the transfer took it."""

    transfer: T
    message: Open


@dataclass(frozen=True)
class ToControl:
    """A CONTROL frame (section 8): for the engine's handler of its type."""

    message: Control


ConnOutput = Send | Close | Deliver[T] | Admit[T] | ToControl


@dataclass(frozen=True)
class ConnLimits:
    """A receiver's per-connection limits (docs/protocol.md 10)."""

    max_transfers: int = 4096  # open (not lingering) transfers on one connection
    max_unknown_tokens: int = 8  # then ABORT, ERROR AUTH_FAILED and close
    max_stray_frames: int = 4096  # DATA for transfers not open here, then ERROR


# ---- keepalive -------------------------------------------------------------------------
class Keepalive:
    """Liveness of one connection (4.5, 4.6).  The driver reports every read
    (:meth:`received`) and write (:meth:`sent`), polls at
    :attr:`next_deadline`, and hands it PING, PONG and ERROR frames
    (:meth:`receive`)."""

    def __init__(self, interval: float, timeout: float, now: float) -> None:
        self.interval = interval
        self.timeout = timeout
        self.last_rx = now
        self.last_tx = now
        self._nonces = itertools.count(1)

    def received(self, now: float) -> None:
        self.last_rx = now

    def sent(self, now: float) -> None:
        self.last_tx = now

    @property
    def next_deadline(self) -> float:
        """When :meth:`poll` may have something to do (a PING due, or the
        peer silent for ``timeout``)."""
        return min(self.last_tx + self.interval, self.last_rx + self.timeout)

    def poll(self, now: float) -> list[Send | Close]:
        """The peer silent for ``timeout``: close without ERROR (nobody would
        read it); else a PING when we sent nothing for ``interval``."""
        # compared as next_deadline computes them: at that time, one of them is due
        if now >= self.last_rx + self.timeout:
            silent = now - self.last_rx
            return [Close(PeerGone(f"peer silent for {silent:.1f} s (keepalive timeout)"), False)]
        if now >= self.last_tx + self.interval:
            return [Send(Ping(next(self._nonces)))]
        return []

    @staticmethod
    def receive(m: Message) -> list[Send | Close] | None:
        """PING is answered with PONG, PONG is dropped, ERROR ends the
        connection with the error its code maps to (no ERROR back); None for
        every other frame (not a keepalive matter)."""
        if isinstance(m, Ping):
            return [Send(Pong(m.nonce))]
        if isinstance(m, Pong):
            return []
        if isinstance(m, Error):
            return [Close(error_for_code(m.code, m.reason, connection=True), False)]
        return None


# ---- the receiver's connection ---------------------------------------------------------
class RxConnection(Generic[T]):
    """A receiver's rules for one authenticated connection."""

    def __init__(self, limits: ConnLimits | None = None) -> None:
        self.limits = limits or ConnLimits()
        self.transfers: dict[int, T] = {}  # transfer id -> the transfer it names here
        # ids in ``transfers`` whose transfer finished and lingers (not open:
        # max_transfers counts the others)
        self.done: set[int] = set()
        self.unknown_tokens = 0
        self.stray = 0

    @property
    def open_transfers(self) -> int:
        return len(self.transfers) - len(self.done)

    def transfer(self, transfer_id: int) -> T | None:
        """The transfer ``transfer_id`` names on this connection, if open here."""
        return self.transfers.get(transfer_id)

    def receive(self, m: Message, find: Callable[[bytes], T | None]) -> list[ConnOutput[T]]:
        """A frame from the sender (after READY; PING, PONG and ERROR go to
        :class:`Keepalive`).  ``find(token)``: the transfer the receiver
        expects under that token, or None."""
        if isinstance(m, Data):
            t = self.transfers.get(m.transfer_id)
            if t is not None:
                return [Deliver(t, m)]
            if m.placed:  # its bytes went nowhere: nothing to count twice
                return []
            self.stray += 1
            if self.stray > self.limits.max_stray_frames:
                return [
                    Close(RemoteProtocolError("too many DATA frames for transfers not open here"))
                ]
            return []
        if isinstance(m, Open):
            return self._open(m, find)
        if isinstance(m, Abort):
            t = self.transfers.get(m.transfer_id)
            return [] if t is None else [Deliver(t, m)]
        if isinstance(m, Control):
            return [ToControl(m)]
        return [Close(RemoteProtocolError(f"a sender may not send {type(m).__name__}"))]

    def _open(self, m: Open, find: Callable[[bytes], T | None]) -> list[ConnOutput[T]]:
        tid = m.transfer_id
        if tid in self.transfers:
            return [Close(RemoteProtocolError(f"transfer id {tid} reused on one connection"))]
        t = find(m.token)
        if t is None:
            self.unknown_tokens += 1
            out: list[ConnOutput[T]] = [
                Send(Abort(tid, ErrorCode.UNKNOWN_TOKEN, "transfer token not issued"))
            ]
            if self.unknown_tokens > self.limits.max_unknown_tokens:
                out.append(
                    Close(AuthenticationError("too many transfer tokens that were never issued"))
                )
            return out
        if self.open_transfers >= self.limits.max_transfers:
            return [Send(Abort(tid, ErrorCode.RESOURCE_LIMIT, "too many open transfers"))]
        return [Admit(t, m)]

    def attached(self, transfer_id: int, transfer: T, *, finished: bool) -> None:
        """The transfer took the OPEN of ``transfer_id`` here (answered RESUME);
        ``finished``: it had ended already (a late OPEN: it lingers here too)."""
        self.transfers[transfer_id] = transfer
        if finished:
            self.done.add(transfer_id)

    def lingers(self, transfer_id: int, transfer: T) -> None:
        """``transfer`` finished: under ``transfer_id`` it lingers here, no longer open."""
        if self.transfers.get(transfer_id) is transfer:
            self.done.add(transfer_id)

    def forget(self, transfer_id: int, transfer: T) -> None:
        """``transfer`` is forgotten: ``transfer_id`` names nothing here any more."""
        if self.transfers.get(transfer_id) is transfer:
            del self.transfers[transfer_id]
            self.done.discard(transfer_id)


# ---- the sender's connection -----------------------------------------------------------
class TxConnection(Generic[T]):
    """A sender's rules for one connection: its transfer ids and what a
    receiver may send on it."""

    def __init__(self) -> None:
        self.transfers: dict[int, T] = {}  # transfer id -> the transfer it names here
        self._ids = itertools.count(1)

    def new_tid(self) -> int:
        """A transfer id never used on this connection (5: never reused)."""
        return next(self._ids)

    def open(self, transfer: T) -> int:
        """A fresh id for ``transfer`` on this connection, which names it from now on."""
        tid = self.new_tid()
        self.bind(tid, transfer)
        return tid

    def bind(self, transfer_id: int, transfer: T) -> None:
        """``transfer_id`` (from :meth:`new_tid`, its OPEN sent) names ``transfer``."""
        self.transfers[transfer_id] = transfer

    def forget(self, transfer_id: int) -> None:
        self.transfers.pop(transfer_id, None)

    def clear(self) -> None:
        """The connection is gone: its ids name nothing any more."""
        self.transfers.clear()

    def receive(self, m: Message) -> list[ConnOutput[T]]:
        """A frame from the receiver (after READY; PING, PONG and ERROR go to
        :class:`Keepalive`).  A reply for an id this connection no longer
        knows (a second COMPLETE, a reply to an OPEN + ABORT) is dropped."""
        if isinstance(m, Control):
            return [ToControl(m)]
        if isinstance(m, REPLIES):
            t = self.transfers.get(m.transfer_id)
            return [] if t is None else [Deliver(t, m)]
        return [Close(RemoteProtocolError(f"a receiver may not send {type(m).__name__}"))]
