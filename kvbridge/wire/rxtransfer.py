"""The receiving side of one TCP transfer, sans-IO (docs/protocol.md section 5).

:class:`RxTransfer` holds every rule of an expected transfer: which OPENs it
accepts (the expectation's fields, each connection attached once, a chunk
size per OPEN), what RESUME reports, where each DATA frame may land, that no
byte is written twice, when a chunk is acknowledged (once every byte of it
is in the sink, on each connection that sent it), NACKs and the limit of
damaged chunks, ABORT, COMPLETE after the sink's flush, the deadline, and
the linger after the end, during which a late OPEN still learns the outcome.

It keeps what it holds as byte ranges, not chunk indices: a resumed or
repeated transfer may use another chunk size, and only the bytes it lacks
are written (docs/protocol.md 5.9).

It never touches a socket, a thread or an event loop: the driver
(``kvbridge.transport.tcp.receiver``) feeds it messages and results and the
time, and carries out the returned outputs.  Connections are opaque keys.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..errors import (
    ChecksumError,
    DecompressError,
    ErrorCode,
    IncompatiblePeer,
    KVBridgeError,
    RemoteProtocolError,
    TransferTimeout,
    error_for_code,
)
from .frames import (
    DATA_CHECK_SIZE,
    DATA_HEADER_SIZE,
    Abort,
    Ack,
    ChunkCodec,
    Complete,
    Data,
    DataHead,
    Message,
    Nack,
    Open,
    Resume,
)
from .ranges import RangeSet

__all__ = [
    "Flush",
    "Forget",
    "Reply",
    "Resolve",
    "RxLimits",
    "RxOutput",
    "RxState",
    "RxTransfer",
    "StopPlacing",
    "Write",
]

C = TypeVar("C", bound=Hashable)


class RxState(enum.Enum):
    EXPECTING = "expecting"  # issued; no OPEN accepted yet
    RECEIVING = "receiving"  # chunks arrive
    FLUSHING = "flushing"  # every byte is written; the sink is being flushed
    COMPLETE = "complete"  # flushed and confirmed; remembered until the linger ends
    FAILED = "failed"  # cancelled, deadline, ABORT, sink error; remembered likewise
    FORGOTTEN = "forgotten"  # the token is no longer known


# ---- outputs ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply(Generic[C]):
    """Send ``message`` on connection ``conn``."""

    conn: C
    message: Message


@dataclass(frozen=True)
class Write:
    """Verify and decode ``data`` (its checksum, its codec) and write the
    parts ``pieces`` (``[start, end)`` byte ranges of the transfer, inside the
    frame's range) into the sink; then report :meth:`RxTransfer.written` or
    :meth:`RxTransfer.write_failed` with ``job``."""

    job: int
    data: Data
    pieces: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Flush:
    """Every byte is written: flush the sink, then report
    :meth:`RxTransfer.flushed` or :meth:`RxTransfer.flush_failed`."""


@dataclass(frozen=True)
class Resolve:
    """Resolve the engine's handle (``error`` None: every byte is in the sink)."""

    error: KVBridgeError | None


@dataclass(frozen=True)
class StopPlacing(Generic[C]):
    """The frame being read into the sink on ``conn`` must not write one more
    byte there (the transfer ended)."""

    conn: C


@dataclass(frozen=True)
class Forget:
    """The linger is over: the token is no longer known."""


RxOutput = Reply[C] | Write | Flush | Resolve | StopPlacing[C] | Forget


@dataclass(frozen=True)
class RxLimits:
    """Per-transfer limits of the receiver (times in seconds)."""

    max_frame: int  # the largest DATA payload: bounds an OPEN's chunk size
    max_bad_chunks: int = 32  # damaged DATA frames, then ABORT CHECKSUM
    linger_s: float = 30.0  # a finished transfer still answers OPEN this long
    codecs: frozenset[int] = frozenset(int(c) for c in ChunkCodec)
    shuffles: frozenset[int] = frozenset((0, 2))


@dataclass
class _Attachment:
    transfer_id: int
    chunk_size: int
    ranged: bool  # both peers announced RANGES: parts of chunks, any RESUME ranges
    source: Hashable = None  # the sender that opened it here (on_open's ``source``)


@dataclass
class _Job(Generic[C]):
    pieces: tuple[tuple[int, int], ...]
    placed_on: C | None = None  # read straight into the sink from this connection
    wire_length: int = 0


@dataclass(eq=False)
class _Waiter(Generic[C]):
    """A DATA frame to acknowledge on ``conn`` once the jobs that write its
    bytes are done (its other bytes were held already)."""

    conn: C
    transfer_id: int
    start: int
    end: int
    jobs: set[int] = field(default_factory=set)
    done: bool = False


class RxTransfer(Generic[C]):
    """One expected transfer.  ``deadline`` is absolute (the clock of ``now``)."""

    _jobs = itertools.count(1)

    def __init__(
        self,
        request_id: str,
        total: int,
        *,
        layout_hash: int = 0,
        token_range: tuple[int, int] = (0, 0),
        layer_range: tuple[int, int] = (0, 0),
        deadline: float,
        now: float,
        limits: RxLimits,
        can_place: bool = False,
    ) -> None:
        self.request_id = request_id
        self.total = total
        self.layout_hash = layout_hash
        self.token_range = tuple(token_range)
        self.layer_range = tuple(layer_range)
        self.deadline = deadline
        self.started = now
        self.limits = limits
        self.can_place = can_place
        self.state = RxState.EXPECTING
        self.error: KVBridgeError | None = None
        self.priority = 0
        # token_start, token_end, layer_start, layer_end of the first OPEN
        self.first_ranges: tuple[int, int, int, int] | None = None
        self.held = RangeSet()  # bytes verified and in the sink
        self.writing = RangeSet()  # bytes of jobs under way
        self.attached: dict[C, _Attachment] = {}
        # the one live source (docs/protocol.md 5.1): the sender whose OPEN
        # was taken; every attached connection is its.  Another sender's OPEN
        # is refused (SOURCE_CONFLICT) while one of them is attached; once
        # none is (closed, reset, keepalive timeout), another may take over.
        self.source: Hashable = None
        self.bound = False
        self.takeovers = 0  # times another source took over a source that was gone
        self.conflicts = 0  # OPENs refused with SOURCE_CONFLICT
        self._jobs_live: dict[int, _Job[C]] = {}
        self._placing: dict[C, int] = {}  # connection -> job being read into the sink
        self._waiting: dict[int, list[_Waiter[C]]] = {}  # job -> frames waiting on it
        self._linger_until: float | None = None
        # statistics
        self.chunks = 0  # DATA frames whose bytes were written
        self.duplicates = 0  # DATA frames whose bytes were all held or under way
        self.bad_chunks = 0  # DATA frames that failed their checksum or decoding
        self.placed = 0  # DATA frames read straight into the sink
        self.wire_bytes = 0  # chunk-body bytes of every DATA frame for this transfer
        self.received = 0  # bytes written into the sink (kept after a failure)

    # ---- queries ---------------------------------------------------------------------
    @property
    def received_bytes(self) -> int:
        return self.received

    @property
    def finished(self) -> bool:
        return self.state in (RxState.COMPLETE, RxState.FAILED, RxState.FORGOTTEN)

    @property
    def running(self) -> bool:
        return self.state in (RxState.EXPECTING, RxState.RECEIVING, RxState.FLUSHING)

    @property
    def next_deadline(self) -> float | None:
        if self.running:
            return self.deadline
        return self._linger_until

    def resume_ranges(self, conn: C) -> tuple[tuple[int, int], ...]:
        """What a RESUME on ``conn`` reports: every held byte range when the
        connection is ranged, else the whole chunks of its OPEN's grid that
        are held (a chunk partly held is not listed: it is sent again whole
        and only its missing bytes are written)."""
        att = self.attached[conn]
        if att.ranged:
            return self.held.spans()
        cs, total = att.chunk_size, self.total
        out: list[tuple[int, int]] = []
        for s, e in self.held:
            a = -(-s // cs) * cs
            b = total if e == total else e // cs * cs
            if b > a:
                out.append((a, b - a))
        return tuple(out)

    # ---- OPEN ------------------------------------------------------------------------
    def on_open(
        self, conn: C, m: Open, ranged: bool, now: float, source: Hashable = None
    ) -> list[RxOutput[C]]:
        """An OPEN of this transfer's token on ``conn`` (``ranged``: both peers
        announced RANGES on it).  ``source`` names the sender that sent it
        (the driver: its authenticated identity and the OPEN's source id;
        equal values are one sender): the first accepted OPEN binds the
        transfer to its source, and another source's OPEN is refused with
        ABORT SOURCE_CONFLICT while a connection of the bound one is
        attached; when none is (each closed), the new source takes over."""
        tid = m.transfer_id
        if self.state in (RxState.FAILED, RxState.FORGOTTEN):
            return [Reply(conn, Abort(tid, ErrorCode.CANCELLED, "transfer no longer expected"))]
        att = self.attached.get(conn)
        if att is not None and self.state is not RxState.COMPLETE:
            return [
                Reply(
                    conn,
                    Abort(
                        tid,
                        ErrorCode.TRANSFER_MISMATCH,
                        f"transfer already open on this connection as id {att.transfer_id}",
                    ),
                )
            ]
        problem = self._mismatch(m, ranged)
        if problem:
            out: list[RxOutput[C]] = [Reply(conn, Abort(tid, ErrorCode.TRANSFER_MISMATCH, problem))]
            if self.state is RxState.EXPECTING:
                out += self._fail(
                    IncompatiblePeer(f"sender's OPEN does not fit: {problem}"), None, now
                )
            return out
        if self.bound and source != self.source:
            if self.attached:  # the bound source is live: one source writes a transfer
                self.conflicts += 1
                return [
                    Reply(
                        conn,
                        Abort(
                            tid,
                            ErrorCode.SOURCE_CONFLICT,
                            "another sender is the live source of this transfer",
                        ),
                    )
                ]
            self.takeovers += 1  # every connection of the bound source is gone
        self.source, self.bound = source, True
        if self.state is RxState.EXPECTING:
            self.state = RxState.RECEIVING
            self.priority = m.priority
            self.first_ranges = (m.token_start, m.token_end, m.layer_start, m.layer_end)
        self.attached[conn] = _Attachment(tid, m.chunk_size, ranged, source)
        out = [Reply(conn, Resume(tid, self.resume_ranges(conn)))]
        if self.state is RxState.COMPLETE:
            out.append(Reply(conn, Complete(tid, self.total)))
        elif self.state is RxState.RECEIVING and self.held.total == self.total:
            self.state = RxState.FLUSHING  # a 0-byte transfer
            out.append(Flush())
        return out

    def _mismatch(self, m: Open, ranged: bool) -> str:
        if m.request_id != self.request_id:
            return f"request id {m.request_id!r} != {self.request_id!r}"
        if m.total_bytes != self.total:
            return f"total bytes {m.total_bytes} != {self.total}"
        if m.layout_hash != self.layout_hash:
            return f"layout hash {m.layout_hash:#x} != {self.layout_hash:#x}"
        if self.token_range != (0, 0) and (m.token_start, m.token_end) != self.token_range:
            return f"token range [{m.token_start}, {m.token_end}) != {self.token_range}"
        if self.layer_range != (0, 0) and (m.layer_start, m.layer_end) != self.layer_range:
            return f"layer range [{m.layer_start}, {m.layer_end}) != {self.layer_range}"
        limit = self.limits.max_frame - DATA_HEADER_SIZE - (DATA_CHECK_SIZE if ranged else 0)
        if not 0 < m.chunk_size <= limit:
            return f"chunk size {m.chunk_size} outside (0, {limit}]"
        ranges = (m.token_start, m.token_end, m.layer_start, m.layer_end)
        if self.first_ranges is not None and ranges != self.first_ranges:
            return f"token and layer ranges {ranges} != {self.first_ranges} of the first OPEN"
        return ""

    # ---- DATA ------------------------------------------------------------------------
    def _grid_problem(self, att: _Attachment, seq: int, offset: int, raw: int) -> str:
        cs, total = att.chunk_size, self.total
        start = seq * cs
        end = min(start + cs, total)
        if not 0 <= offset < total:
            return f"offset {offset} is not on the chunk grid"
        if att.ranged:
            if start > offset or raw <= 0 or offset + raw > end:
                return f"DATA [{offset}, {offset + raw}) is not inside chunk {seq} [{start}, {end})"
            return ""
        if offset % cs:
            return f"offset {offset} is not on the chunk grid"
        if offset // cs != seq:
            return f"DATA seq {seq} does not match offset {offset}"
        if raw != end - start:
            return f"chunk at {offset} has length {raw}, not {end - start}"
        return ""

    def _missing(self, a: int, b: int) -> list[tuple[int, int]]:
        """Bytes of ``[a, b)`` neither held nor being written."""
        out: list[tuple[int, int]] = []
        for x, y in self.held.missing(a, b):
            out += self.writing.missing(x, y)
        return out

    def place(self, conn: C, head: DataHead) -> int | None:
        """Whether the bytes of the DATA frame whose header ``head`` just
        arrived on ``conn`` may be read straight into the sink at
        ``head.offset``: a job number if so (the driver asks the sink for the
        memory, then reports the frame with :meth:`on_data`), else None (the
        frame gets its own buffer; :meth:`on_data` judges it)."""
        att = self.attached.get(conn)
        if (
            not self.can_place
            or self.state is not RxState.RECEIVING
            or att is None
            or att.transfer_id != head.transfer_id
            or conn in self._placing
            or head.codec != ChunkCodec.RAW
            or head.shuffle
            or head.wire_length != head.raw_length
            or self._grid_problem(att, head.seq, head.offset, head.raw_length)
        ):
            return None
        a, b = head.offset, head.offset + head.raw_length
        if self.held.overlaps(a, b) or self.writing.overlaps(a, b):
            return None
        job = next(self._jobs)
        self._jobs_live[job] = _Job(((a, b),), placed_on=conn, wire_length=head.wire_length)
        self.writing.add(a, b)
        self._placing[conn] = job
        self._wait(_Waiter(conn, att.transfer_id, a, b, {job}))
        return job

    def place_failed(self, conn: C, error: KVBridgeError, now: float) -> list[RxOutput[C]]:
        """The sink could not lend the memory :meth:`place` chose."""
        job = self._placing.pop(conn, None)
        if job is not None:
            self._drop_job(job)
        return self._fail(error, ErrorCode.SINK_ERROR, now)

    def on_data(self, conn: C, m: Data, now: float) -> list[RxOutput[C]]:
        """A DATA frame of this transfer on ``conn``.  Raises
        :class:`RemoteProtocolError` for a frame that breaks a rule of the
        connection (grid, codec): the driver closes that connection, the
        transfer lives on."""
        att = self.attached.get(conn)
        if att is None or att.transfer_id != m.transfer_id:
            return []
        if m.placed:
            return self._on_placed(conn, m, now)
        if self.state in (RxState.FAILED, RxState.FORGOTTEN):
            return []
        problem = self._grid_problem(att, m.seq, m.offset, m.raw_length)
        if problem:
            raise RemoteProtocolError(problem)
        if m.codec not in self.limits.codecs or m.shuffle not in self.limits.shuffles:
            raise RemoteProtocolError(f"DATA with codec {m.codec}, shuffle {m.shuffle}")
        self.wire_bytes += m.wire_length
        a, b = m.offset, m.offset + m.raw_length
        ack: Message = Ack(m.transfer_id, ((a, b - a),))
        if self.held.covers(a, b):
            self.duplicates += 1
            return [Reply(conn, ack)]
        missing = self._missing(a, b)
        whole = missing == [(a, b)]
        # the jobs already writing bytes of this frame (none in the common case)
        jobs = (
            set()
            if whole
            else {j for j, jb in self._jobs_live.items() if _touches(jb.pieces, a, b)}
        )
        if not missing:  # every byte is under way from another frame: ACK when written
            self.duplicates += 1
            self._wait(_Waiter(conn, m.transfer_id, a, b, jobs))
            return []
        job = next(self._jobs)
        pieces = tuple(missing)
        self._jobs_live[job] = _Job(pieces, wire_length=m.wire_length)
        for x, y in pieces:
            self.writing.add(x, y)
        jobs.add(job)
        self._wait(_Waiter(conn, m.transfer_id, a, b, jobs))
        return [Write(job, m, pieces)]

    def _wait(self, w: _Waiter[C]) -> None:
        for j in w.jobs:
            self._waiting.setdefault(j, []).append(w)

    def _on_placed(self, conn: C, m: Data, now: float) -> list[RxOutput[C]]:
        job = self._placing.pop(conn, None)
        if job is None or job not in self._jobs_live or self.finished:
            return []
        self.wire_bytes += m.wire_length
        if m.digest != m.checksum:
            return self.write_failed(job, ChecksumError("checksum mismatch"), now)
        self.placed += 1
        return self.written(job, now)

    def written(self, job: int, now: float) -> list[RxOutput[C]]:
        """The job's bytes are verified and in the sink."""
        jb = self._jobs_live.pop(job, None)
        if jb is None:
            return []
        for x, y in jb.pieces:
            self.writing.remove(x, y)
        if self.state is not RxState.RECEIVING:
            return []
        for x, y in jb.pieces:
            self.received += self.held.add(x, y)
        self.chunks += 1
        out: list[RxOutput[C]] = []
        for w in self._waiting.pop(job, ()):
            w.jobs.discard(job)
            if w.done or w.jobs:
                continue
            w.done = True  # every job it waited on is written: its bytes are held
            if w.conn in self.attached:
                out.append(Reply(w.conn, Ack(w.transfer_id, ((w.start, w.end - w.start),))))
        if self.held.total == self.total:
            self.state = RxState.FLUSHING
            out.append(Flush())
        return out

    def write_failed(self, job: int, error: BaseException, now: float) -> list[RxOutput[C]]:
        """The job's frame failed its checksum or decoding (ChecksumError,
        DecompressError: asked for again), or the sink failed (the transfer
        fails with SINK_ERROR)."""
        if job not in self._jobs_live:
            return []
        if not isinstance(error, ChecksumError):
            self._drop_job(job)
            err = (
                error
                if isinstance(error, KVBridgeError)
                else KVBridgeError(f"sink failed: {error!r}")
            )
            return self._fail(err, ErrorCode.SINK_ERROR, now)
        code = ErrorCode.DECOMPRESS if isinstance(error, DecompressError) else ErrorCode.CHECKSUM
        self.bad_chunks += 1
        out = self._drop_job(job, code)
        if self.bad_chunks > self.limits.max_bad_chunks:
            out += self._fail(ChecksumError("too many damaged chunks"), ErrorCode.CHECKSUM, now)
        return out

    def _drop_job(self, job: int, code: int = ErrorCode.CHECKSUM) -> list[RxOutput[C]]:
        """A job whose bytes did not make it: every frame waiting on it whose
        bytes are now missing is asked for again (NACK ``code``)."""
        jb = self._jobs_live.pop(job, None)
        if jb is None:
            return []
        for x, y in jb.pieces:
            self.writing.remove(x, y)
        # no other job writes those bytes (jobs are disjoint): each frame that
        # waited on this one now lacks bytes
        out: list[RxOutput[C]] = []
        for w in self._waiting.pop(job, ()):
            if w.done:
                continue
            w.done = True
            if w.conn in self.attached and self.running:
                out.append(Reply(w.conn, Nack(w.transfer_id, w.start, w.end - w.start, code)))
        return out

    # ---- the end ---------------------------------------------------------------------
    def flushed(self, now: float) -> list[RxOutput[C]]:
        if self.state is not RxState.FLUSHING:
            return []
        self.state = RxState.COMPLETE
        self._linger_until = now + self.limits.linger_s
        self._waiting.clear()
        out: list[RxOutput[C]] = [Resolve(None)]
        out += [Reply(c, Complete(a.transfer_id, self.total)) for c, a in self.attached.items()]
        return out

    def flush_failed(self, error: KVBridgeError, now: float) -> list[RxOutput[C]]:
        return self._fail(error, ErrorCode.SINK_ERROR, now)

    def on_abort(self, conn: C, m: Abort, now: float) -> list[RxOutput[C]]:
        """The sender ended the transfer."""
        att = self.attached.get(conn)
        if att is None or att.transfer_id != m.transfer_id:
            return []
        return self._fail(error_for_code(m.code, m.reason), None, now)

    def conn_lost(self, conn: C, now: float) -> list[RxOutput[C]]:
        """``conn`` closed: a chunk cut off mid-frame there is needed again."""
        out: list[RxOutput[C]] = []
        job = self._placing.pop(conn, None)
        self.attached.pop(conn, None)
        for ws in self._waiting.values():
            for w in ws:
                if w.conn == conn:
                    w.done = True
        if job is not None:
            out += self._drop_job(job)
        return out

    def cancel(self, error: KVBridgeError, code: int, now: float) -> list[RxOutput[C]]:
        """End the transfer here and tell the sender (ABORT ``code``)."""
        return self._fail(error, code, now)

    def poll(self, now: float) -> list[RxOutput[C]]:
        if self.running and now >= self.deadline:
            return self._fail(
                TransferTimeout(
                    f"transfer {self.request_id!r} not complete after "
                    f"{self.deadline - self.started:g} s"
                ),
                ErrorCode.TIMEOUT,
                now,
            )
        if (
            self._linger_until is not None
            and now >= self._linger_until
            and self.state in (RxState.COMPLETE, RxState.FAILED)
        ):
            self.state = RxState.FORGOTTEN
            self._linger_until = None
            return [Forget()]
        return []

    def _fail(self, error: KVBridgeError, code: int | None, now: float) -> list[RxOutput[C]]:
        if not self.running:
            return []
        self.state = RxState.FAILED
        self.error = error
        self._linger_until = now + self.limits.linger_s
        out: list[RxOutput[C]] = [StopPlacing(c) for c in self._placing]
        self._placing.clear()
        out.append(Resolve(error))
        if code is not None:
            reason = str(error)[:1000]
            out += [Reply(c, Abort(a.transfer_id, code, reason)) for c, a in self.attached.items()]
        self.held.clear()
        self._waiting.clear()
        return out


def _touches(pieces: tuple[tuple[int, int], ...], a: int, b: int) -> bool:
    return any(x < b and a < y for x, y in pieces)
