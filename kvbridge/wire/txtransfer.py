"""The sending side of one TCP transfer, sans-IO (docs/protocol.md section 5).

:class:`TxTransfer` holds every rule of an outgoing transfer: the chunk grid,
which byte ranges the receiver confirmed (ACK, RESUME), which chunks are on
their way on which connection and until when an acknowledgement may take
(the ack timer), NACKs and the resend limit, ABORT and COMPLETE, the cancel
of a transfer that was never opened, the deadline of the whole transfer, the
reconnect deadline (counted from the moment the transfer last had no usable
connection), for a layer-wise source, how long a chunk may wait for its
bytes to become ready, and how much may be sent before the receiver's first
RESUME told what it holds (``early_bytes``: a transfer sent again, by a
restarted sender say, repeats at most that much).

It never touches a socket, a thread or an event loop: the driver
(``kvbridge.transport.tcp.sender``) feeds it messages, connection events and
the time, and carries out the returned outputs.  Connections are opaque keys
(``link``).  :attr:`TxTransfer.next_deadline` says when to call
:meth:`TxTransfer.poll` next.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import (
    ChecksumError,
    ErrorCode,
    InvalidArgument,
    KVBridgeError,
    PeerGone,
    RemoteProtocolError,
    TransferTimeout,
    error_for_code,
)
from .frames import Abort, Ack, Complete, Nack, Open, Resume
from .grid import ChunkGrid
from .ranges import RangeSet

__all__ = [
    "AbortUnopened",
    "AckClock",
    "Finished",
    "LinkClock",
    "SendAbort",
    "TxOutput",
    "TxState",
    "TxTransfer",
    "Wake",
]

L = TypeVar("L", bound=Hashable)

MAX_BACKOFF = 32  # an unacknowledged chunk's ack timer doubles at most to this factor


class TxState(enum.Enum):
    NEW = "new"  # waiting for a connection; the chunk size is not fixed yet
    SENDING = "sending"  # the chunk grid is fixed; chunks go out
    DONE = "done"  # the receiver sent COMPLETE
    FAILED = "failed"  # cancelled, deadline, ABORT, too many resends, no connection


# ---- outputs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SendAbort(Generic[L]):
    """Send ``Abort(transfer_id, code, reason)`` on ``link``."""

    link: L
    message: Abort


@dataclass(frozen=True)
class AbortUnopened:
    """The transfer ended before any OPEN for it went out: send OPEN and then
    ABORT(code, reason) under a fresh id on one live connection, now or as
    soon as there is one, so that the receiver learns of it at once."""

    code: int
    reason: str


@dataclass(frozen=True)
class Wake:
    """Chunks of this transfer became sendable (again)."""


@dataclass(frozen=True)
class Finished:
    """The transfer ended: ``error`` None means the receiver confirmed every byte."""

    error: KVBridgeError | None


TxOutput = SendAbort[L] | AbortUnopened | Wake | Finished


# ---- loss detection ----------------------------------------------------------------------
# A connection delivers in order and the receiver answers every DATA frame
# (ACK or NACK), so a chunk is known lost when its connection acknowledged
# more bytes than were sent on it ahead of the chunk (it was overtaken: the
# receiver dropped it).  Otherwise only a connection that makes no progress
# for a while (a blackhole; the last chunk dropped) says so: the stall time
# is rate-aware, so a chunk queued behind others on a slow link is not taken
# for lost.
STALL_CHUNKS = 4.0  # a stall: no reply for this many chunk times at the link's rate
INITIAL_STALL = 20.0  # ... or for this long while the link's rate is unknown


class AckClock:
    """How long a chunk may wait for its ACK once a later chunk on its
    connection was acknowledged: ``max(floor, srtt + 4 * rttvar)`` over the
    measured waits (RFC 6298's estimator; a chunk sent again is not
    measured), ``2 * floor`` before the first measurement.  A wait is
    measured from the later of the moment the chunk was handed to its
    connection and the connection's previous reply.  One per sender: the
    delay is the link's, not a transfer's."""

    def __init__(self, floor: float) -> None:
        if not floor > 0:
            raise InvalidArgument("ack_timeout must be positive")
        self.floor = floor
        self.srtt: float | None = None
        self.rttvar = 0.0

    def observe(self, sample: float) -> None:
        if sample < 0:
            return
        if self.srtt is None:
            self.srtt, self.rttvar = sample, sample / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
            self.srtt = 0.875 * self.srtt + 0.125 * sample

    @property
    def rto(self) -> float:
        if self.srtt is None:
            return 2 * self.floor
        return max(self.floor, self.srtt + 4 * self.rttvar)


@dataclass(eq=False)
class _Flight(Generic[L]):
    link: L
    sent_at: float | None = None  # None while the chunk is being prepared
    nbytes: int = 0  # raw bytes of its DATA frames
    bytes_before: int = 0  # bytes sent on the link before it
    backoff: int = 1
    overtaken_at: float | None = None  # when its link acknowledged bytes sent after it
    done: bool = False  # acknowledged, NACKed, timed out or lost with its link


class LinkClock:
    """What one connection tells about loss, for every transfer on it (the
    driver keeps one per connection and reports each reply): the bytes sent
    and acknowledged on it, when it last replied, its measured rate, and
    which chunks on it were overtaken."""

    def __init__(self, now: float) -> None:
        self.sent_bytes = 0
        self.acked_bytes = 0
        self.progress_at = now
        self._busy_bytes = 0.0
        self._busy_time = 0.0
        self._out: deque[_Flight[Any]] = deque()  # outstanding, in send order

    @property
    def rate(self) -> float | None:
        """Acknowledged bytes per second while busy (None: not measured yet)."""
        if self._busy_time <= 0 or self._busy_bytes <= 0:
            return None
        return self._busy_bytes / self._busy_time

    def on_send(self, f: _Flight[Any], nbytes: int) -> None:
        f.bytes_before, f.nbytes = self.sent_bytes, nbytes
        self.sent_bytes += nbytes
        self._out.append(f)

    def on_reply(self, acked: int, now: float) -> None:
        """A reply arrived (``acked``: the bytes an ACK lists; 0 for others)."""
        out = self._out
        while out and out[0].done:
            out.popleft()
        if acked and out:  # busy: a rate sample
            self._busy_bytes = 0.9 * self._busy_bytes + acked
            self._busy_time = 0.9 * self._busy_time + max(0.0, now - self.progress_at)
        self.acked_bytes += acked
        self.progress_at = now
        for f in out:  # in send order: those with less acknowledged ahead stop it
            if f.bytes_before >= self.acked_bytes:
                break
            if not f.done and f.overtaken_at is None:
                f.overtaken_at = now

    def stall_time(self, nbytes: int, rto: float) -> float:
        """How long the link may stay silent before a chunk of ``nbytes`` on
        it counts as lost."""
        rate = self.rate
        if rate is None:
            return max(rto, INITIAL_STALL)
        return max(rto, STALL_CHUNKS * nbytes / rate)


@dataclass
class TxLimits:
    """The sender's rules for one transfer (times in seconds)."""

    max_resends: int = 8  # NACKs of one chunk in a row, then ChecksumError
    reconnect_timeout: float = 30.0  # without any usable connection, then PeerGone
    ready_timeout: float | None = None  # a chunk waiting for its bytes (layer-wise)


class TxTransfer(Generic[L]):
    """One outgoing transfer.  ``deadline`` is absolute (the clock of ``now``)."""

    _arrivals = itertools.count()

    def __init__(
        self,
        request_id: str,
        token: bytes,
        total: int,
        *,
        layout_hash: int = 0,
        token_range: tuple[int, int] = (0, 0),
        layer_range: tuple[int, int] = (0, 0),
        priority: int = 0,
        deadline: float,
        now: float,
        clock: AckClock,
        limits: TxLimits | None = None,
        ready_bytes: int | None = None,
        planned_chunk: int = 1 << 20,
        link_clock: Callable[[L], LinkClock] | None = None,
        source_id: bytes = b"",
    ) -> None:
        self.request_id = request_id
        self.source_id = source_id  # the sender's, in every OPEN (5.1; b"": none)
        self.token = token
        self.total = total
        self.layout_hash = layout_hash
        self.token_range = token_range
        self.layer_range = layer_range
        self.priority = priority
        self.arrival = next(self._arrivals)
        self.deadline = deadline
        self.started = now
        self.clock = clock
        # each connection's LinkClock (progress, overtaking); without one (a
        # test) a chunk counts as lost ``rto`` after its send
        self._link_clock = link_clock
        self.limits = limits or TxLimits()
        self.state = TxState.NEW
        self.error: KVBridgeError | None = None
        self.grid: ChunkGrid | None = None
        self.planned_chunk = planned_chunk  # the OPEN's chunk size before start()
        self.acked = RangeSet()  # bytes the receiver holds (ACK, RESUME)
        self.opened: dict[L, int] = {}  # live connection -> our transfer id on it
        self.inflight: dict[int, _Flight[L]] = {}
        self.nacks: dict[int, int] = {}  # NACKs of a chunk since its last ACK
        self.timeouts: dict[int, int] = {}  # ack timeouts of a chunk (its backoff)
        self._heap: list[int] = []
        self._pending: set[int] = set()
        self.ready_bytes = total if ready_bytes is None else min(ready_bytes, total)
        self._ready_since = now
        self._no_link_since: float | None = now  # no connection known yet
        # before the first RESUME nothing is known of what the receiver
        # holds: at most ``early_bytes`` of chunks go out (None: no limit)
        self.resumed = False
        self.early_bytes: int | None = None
        self.early_sent = 0
        self.unopened_abort: tuple[int, str] | None = None  # owed: OPEN + ABORT
        # counters for the driver's statistics
        self.retries = 0  # chunks sent again (NACK, lost connection, ack timeout)
        self.chunks_sent = 0

    # ---- queries ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.state in (TxState.DONE, TxState.FAILED)

    @property
    def acked_bytes(self) -> int:
        return self.acked.total

    @property
    def chunk_size(self) -> int:
        return self.grid.chunk_size if self.grid is not None else self.planned_chunk

    def open_message(self, transfer_id: int, codecs: int) -> Open:
        """The OPEN that attaches a connection (``codecs``: the capability bits
        this transfer may use)."""
        return Open(
            transfer_id,
            self.token,
            self.layout_hash,
            self.total,
            self.chunk_size,
            self.token_range[0],
            self.token_range[1],
            self.layer_range[0],
            self.layer_range[1],
            codecs,
            self.priority,
            self.request_id,
            self.source_id,
        )

    @property
    def next_deadline(self) -> float | None:
        if self.finished:
            return None
        ds = [self.deadline]
        ds += [self._ack_deadline(f) for f in self.inflight.values() if f.sent_at is not None]
        if self._no_link_since is not None:
            ds.append(self._no_link_since + self.limits.reconnect_timeout)
        if self._waiting_for_bytes() and self.limits.ready_timeout is not None:
            ds.append(self._ready_since + self.limits.ready_timeout)
        return min(ds)

    # the scheduler's view (kvbridge.transport.tcp.scheduler.Schedulable)
    @property
    def unsent_bytes(self) -> int:
        return len(self._pending) * self.chunk_size if self.grid is not None else 0

    @property
    def pending_chunks(self) -> int:
        return 0 if self.finished else len(self._pending)

    def has_pending(self) -> bool:
        """A chunk is waiting to be sent, its bytes are ready, and it may go
        now (before the first RESUME: within ``early_bytes``)."""
        if self.state is not TxState.SENDING or not self._pending:
            return False
        early = self.early_bytes
        if not self.resumed and early is not None and self.early_sent >= early:
            return False
        return self._ready(self._lowest())

    def pop_pending(self) -> int:
        """The next chunk to send (the lowest index; its bytes are ready)."""
        idx = self._lowest()
        heapq.heappop(self._heap)
        self._pending.discard(idx)
        return idx

    def pieces(self, idx: int, ranged: bool) -> list[tuple[int, int]]:
        """``(offset, length)`` of the DATA frames that chunk ``idx`` needs now:
        its bytes the receiver does not hold (``ranged``: the receiver takes
        parts of a chunk), else the whole chunk unless it is all held."""
        assert self.grid is not None
        off, n = self.grid.span(idx)
        missing = self.acked.missing(off, off + n)
        if not missing:
            return []
        if not ranged:
            return [(off, n)]
        return [(a, b - a) for a, b in missing]

    # ---- events ----------------------------------------------------------------------
    def start(
        self, chunk_size: int, now: float, early_bytes: int | None = None
    ) -> list[TxOutput[L]]:
        """A connection is up: fix the chunk grid and queue every chunk.
        ``early_bytes``: how many bytes of chunks may go out before the
        first RESUME (None: no limit); the chunk that crosses it still goes."""
        if self.state is not TxState.NEW:
            return []
        self.early_bytes = early_bytes
        self.grid = ChunkGrid(self.total, chunk_size)
        self._heap = list(range(self.grid.count))
        self._pending = set(self._heap)
        self.state = TxState.SENDING
        self._ready_since = now
        return [Wake()]

    def attach(self, link: L, transfer_id: int) -> None:
        """An OPEN for this transfer went out on ``link`` under ``transfer_id``."""
        if link in self.opened:
            raise InvalidArgument("a transfer attaches to a connection once")
        self.opened[link] = transfer_id

    def claim(self, link: L, idx: int) -> None:
        """Chunk ``idx`` is being prepared for ``link``."""
        self.inflight[idx] = _Flight(link)
        if not self.resumed and self.grid is not None:
            self.early_sent += self.grid.span(idx)[1]

    def sent(self, link: L, idx: int, frames: int, now: float, nbytes: int = 0) -> None:
        """Chunk ``idx`` went out on ``link`` (``frames`` DATA frames of
        ``nbytes`` raw bytes): its ack timer starts."""
        f = self.inflight.get(idx)
        if f is None or f.link != link:
            return
        f.backoff = min(MAX_BACKOFF, 2 ** self.timeouts.get(idx, 0))
        f.sent_at = now
        if self._link_clock is not None:
            self._link_clock(link).on_send(f, nbytes)
        self.chunks_sent += frames

    def unclaim(self, link: L, idx: int) -> list[TxOutput[L]]:
        """The chunk claimed for ``link`` did not go out: it is needed again."""
        f = self.inflight.get(idx)
        if f is not None and f.link == link:
            del self.inflight[idx]
            f.done = True
        return [Wake()] if self._requeue(idx) else []

    def owns(self, link: L, idx: int) -> bool:
        """Whether chunk ``idx`` is still claimed by ``link`` and still needed."""
        f = self.inflight.get(idx)
        return not self.finished and f is not None and f.link == link

    def set_ready(self, ready_bytes: int, now: float) -> list[TxOutput[L]]:
        """A layer-wise source has the bytes ``[0, ready_bytes)`` ready."""
        ready_bytes = min(ready_bytes, self.total)
        if ready_bytes <= self.ready_bytes:
            return []
        self.ready_bytes = ready_bytes
        self._ready_since = now
        return [Wake()] if self.has_pending() else []

    def links_changed(self, live: int, now: float) -> None:
        """The sender has ``live`` usable connections now."""
        if live > 0:
            self._no_link_since = None
        elif self._no_link_since is None:
            self._no_link_since = now

    def link_lost(self, link: L, now: float) -> list[TxOutput[L]]:
        """``link`` closed: what was on its way there is sent again elsewhere."""
        self.opened.pop(link, None)
        woke = False
        for idx, f in list(self.inflight.items()):
            if f.link == link:
                del self.inflight[idx]
                f.done = True
                if f.sent_at is not None:
                    self.retries += 1
                woke = self._requeue(idx) or woke
        return [Wake()] if woke else []

    def on_message(
        self, link: L, m: Ack | Resume | Nack | Abort | Complete, now: float
    ) -> list[TxOutput[L]]:
        """A reply from the receiver about this transfer on ``link``.  Raises
        :class:`RemoteProtocolError` for a reply that breaks the protocol
        (the driver closes that connection)."""
        if self.finished:
            return []
        if isinstance(m, Ack):
            self._confirm(link, m.ranges, now, measure=True)
            return []
        if isinstance(m, Resume):
            self._confirm(link, m.held, now, measure=False)
            if not self.resumed:
                self.resumed = True  # what is missing is known: the rest may go
                return [Wake()] if self.has_pending() else []
            return []
        if isinstance(m, Nack):
            return self._on_nack(link, m)
        if isinstance(m, Abort):
            return self._fail(error_for_code(m.code, m.reason), None)
        if m.total_bytes != self.total:
            raise RemoteProtocolError(f"COMPLETE for {m.total_bytes} bytes, sent {self.total}")
        self.acked = RangeSet([(0, self.total)]) if self.total else RangeSet()
        return self._end(None)

    def cancel(self, error: KVBridgeError, code: int) -> list[TxOutput[L]]:
        """End the transfer here and tell the receiver (ABORT ``code``)."""
        return self._fail(error, code)

    def fail(self, error: KVBridgeError) -> list[TxOutput[L]]:
        """End the transfer without telling the receiver (it cannot be told,
        or it told us)."""
        return self._fail(error, None)

    def poll(self, now: float) -> list[TxOutput[L]]:
        """Act on every deadline that passed by ``now``."""
        if self.finished:
            return []
        if now >= self.deadline:
            return self._fail(
                TransferTimeout(
                    f"transfer {self.request_id!r} not confirmed after "
                    f"{self.deadline - self.started:g} s"
                ),
                ErrorCode.TIMEOUT,
            )
        if (
            self._no_link_since is not None
            and now - self._no_link_since >= self.limits.reconnect_timeout
        ):
            return self._fail(
                PeerGone(
                    f"transfer {self.request_id!r} had no usable connection for "
                    f"{self.limits.reconnect_timeout} s"
                ),
                None,
            )
        rt = self.limits.ready_timeout
        if rt is not None and self._waiting_for_bytes() and now - self._ready_since >= rt:
            return self._fail(
                TransferTimeout(
                    f"transfer {self.request_id!r}: bytes from {self.ready_bytes} not ready "
                    f"after {rt} s"
                ),
                ErrorCode.TIMEOUT,
            )
        woke = False
        for idx, f in list(self.inflight.items()):
            if f.sent_at is not None and now >= self._ack_deadline(f):
                # not acknowledged in time: lost, or damaged on the way in its
                # header (a receiver drops what it cannot attribute): send again
                del self.inflight[idx]
                f.done = True
                self.timeouts[idx] = self.timeouts.get(idx, 0) + 1
                self.retries += 1
                woke = self._requeue(idx) or woke
        return [Wake()] if woke else []

    # ---- internals -------------------------------------------------------------------
    def _ack_deadline(self, f: _Flight[L]) -> float:
        """When chunk ``f`` counts as lost (each times its backoff): ``rto``
        after its connection acknowledged bytes sent after it (overtaken:
        the receiver dropped it); else the connection's stall time after the
        later of its send and the connection's last reply."""
        assert f.sent_at is not None
        rto = self.clock.rto
        if self._link_clock is None:
            return f.sent_at + rto * f.backoff
        if f.overtaken_at is not None:
            return f.overtaken_at + rto * f.backoff
        lc = self._link_clock(f.link)
        return max(f.sent_at, lc.progress_at) + lc.stall_time(f.nbytes, rto) * f.backoff

    def _lowest(self) -> int:
        heap = self._heap
        while heap[0] not in self._pending:
            heapq.heappop(heap)
        return heap[0]

    def _ready(self, idx: int) -> bool:
        assert self.grid is not None
        off, n = self.grid.span(idx)
        return off + n <= self.ready_bytes

    def _waiting_for_bytes(self) -> bool:
        return (
            self.state is TxState.SENDING
            and bool(self._pending)
            and self.ready_bytes < self.total
            and not self._ready(self._lowest())
        )

    def _requeue(self, idx: int) -> bool:
        """Chunk ``idx`` is needed again (unless it is held or queued already)."""
        if self.finished or idx in self._pending or self.grid is None:
            return False
        off, n = self.grid.span(idx)
        if self.acked.covers(off, off + n):
            return False
        self._pending.add(idx)
        heapq.heappush(self._heap, idx)
        return True

    def _confirm(
        self, link: L, ranges: tuple[tuple[int, int], ...], now: float, *, measure: bool
    ) -> None:
        grid = self.grid
        if grid is None:
            raise RemoteProtocolError("ACK or RESUME before OPEN")
        for off, n in ranges:
            if off < 0 or n <= 0 or off + n > self.total:
                raise RemoteProtocolError(
                    f"range ({off}, {n}) outside the {self.total}-byte transfer"
                )
        cs = grid.chunk_size
        for off, n in ranges:
            if not self.acked.add(off, off + n):
                continue
            for idx in range(off // cs, (off + n - 1) // cs + 1):
                a, k = grid.span(idx)
                if not self.acked.covers(a, a + k):
                    continue
                self._pending.discard(idx)
                self.nacks.pop(idx, None)
                f = self.inflight.pop(idx, None)
                if f is not None:
                    f.done = True
                    if (
                        measure
                        and f.link == link
                        and f.sent_at is not None
                        and idx not in self.timeouts
                    ):
                        since = f.sent_at
                        if self._link_clock is not None:
                            since = max(since, self._link_clock(link).progress_at)
                        self.clock.observe(now - since)
                self.timeouts.pop(idx, None)

    def _on_nack(self, link: L, m: Nack) -> list[TxOutput[L]]:
        grid = self.grid
        if grid is None or not 0 <= m.offset < self.total or m.length <= 0:
            raise RemoteProtocolError(f"NACK of ({m.offset}, {m.length}) outside the transfer")
        idx = m.offset // grid.chunk_size
        off, n = grid.span(idx)
        if self.acked.covers(off, off + n):
            return []
        f = self.inflight.get(idx)
        if f is not None and f.link == link:
            del self.inflight[idx]
            f.done = True
        elif f is not None:
            return []  # already on its way again on another connection
        count = self.nacks.get(idx, 0) + 1
        self.nacks[idx] = count
        self.retries += 1
        if count > self.limits.max_resends:
            return self._fail(
                ChecksumError(f"chunk {idx} damaged {count} times in a row"), ErrorCode.CHECKSUM
            )
        return [Wake()] if self._requeue(idx) else []

    def _fail(self, error: KVBridgeError, code: int | None) -> list[TxOutput[L]]:
        if self.finished:
            return []
        out: list[TxOutput[L]] = []
        if code is not None:
            reason = str(error)[:1000]
            out += [SendAbort(link, Abort(tid, code, reason)) for link, tid in self.opened.items()]
            if not self.opened:
                self.unopened_abort = (code, reason)
                out.append(AbortUnopened(code, reason))
        return out + self._end(error)

    def _end(self, error: KVBridgeError | None) -> list[TxOutput[L]]:
        self.state = TxState.DONE if error is None else TxState.FAILED
        self.error = error
        for f in self.inflight.values():
            f.done = True
        self.inflight.clear()
        self._pending.clear()
        self._heap.clear()
        return [Finished(error)]
