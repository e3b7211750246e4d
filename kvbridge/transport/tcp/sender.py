"""The sending side: N parallel connections, chunks striped across them.

:class:`TcpSender` is a thin driver.  The rules of each transfer (what is
confirmed, what to send again and when, ABORT, COMPLETE, the deadlines) are
the sans-IO :class:`~kvbridge.wire.txtransfer.TxTransfer`; the connections
are a :class:`~kvbridge.transport.tcp.links.LinkPool`; chunk preparation is a
:class:`~kvbridge.transport.tcp.prepare.Preparer`.  The driver feeds the
state machines the replies, connection events and the time, and carries out
what they return.

Each connection has one writer task.  A writer asks the
:class:`~kvbridge.transport.tcp.scheduler.ChunkScheduler` for the next chunk of
any transfer whose bytes are ready, prepares it (so chunk k+1 is being
prepared while chunk k drains from the socket buffer), and writes it.  A
layer-wise transfer whose next layer is not ready offers no chunk, so it
waits on the event loop and holds no thread, and the other transfers' chunks
go first.  Completion is reported only on the receiver's COMPLETE.

A small transfer started while nothing else waits to be sent takes a short
way: :meth:`TcpSender.send` itself prepares its chunks on the event loop and
writes each with its OPEN, in one write, on a connection whose writer is
idle (the scheduler would have picked it first anyway): no task, no worker
thread, no wake-up of a writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl as _ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...errors import (
    Cancelled,
    ErrorCode,
    InvalidArgument,
    KVBridgeError,
    PeerGone,
)
from ...wire.connection import REPLIES, Close, Deliver, ToControl
from ...wire.description import PeerDescription
from ...wire.frames import (
    ALL_CAPABILITIES,
    CODEC_CAPABILITIES,
    DATA_CHECK_SIZE,
    DATA_HEADER_SIZE,
    DEFAULT_MAX_FRAME,
    SOURCE_SIZE,
    TOKEN_SIZE,
    Abort,
    Ack,
    Data,
    Message,
)
from ...wire.handshake import ClientHandshake
from ...wire.txtransfer import (
    AbortUnopened,
    AckClock,
    Finished,
    LinkClock,
    SendAbort,
    TxLimits,
    TxOutput,
    TxTransfer,
    Wake,
)
from ..handle import SendStats, transfer_timeout
from .compress import CompressionDecision, CompressionPolicy
from .conn import FrameConnection
from .handles import SendHandle
from .kvio import Source, is_source
from .links import Link, LinkPool
from .prepare import Encoded, Preparer
from .scheduler import ChunkScheduler

log = logging.getLogger("kvbridge.transport")

__all__ = ["DEFAULT_CHUNK", "DEFAULT_STREAMS", "SendHandle", "SendStats", "TcpSender"]

DEFAULT_STREAMS = 4
DEFAULT_CHUNK = 4 << 20
MIN_AUTO_CHUNK = 256 << 10
CHUNK_SECONDS = 0.03  # auto chunk size: about this long on one stream at the measured rate
DATA_OVERHEAD = DATA_HEADER_SIZE + DATA_CHECK_SIZE  # a DATA payload beyond its chunk bytes


class _Tx(TxTransfer[Link]):
    """A transfer's rules plus what the driver keeps beside them."""

    def __init__(self, handle: SendHandle, source: Source, mode: str | None, **kw: Any) -> None:
        super().__init__(**kw)
        self.handle = handle
        self.source = source
        self.mode = mode
        self.stats = handle.stats
        self.decision: CompressionDecision | None = None
        self.decide_lock = asyncio.Lock()
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf
        self.tids: list[tuple[Link, int]] = []  # every (connection, id) it was opened under
        self.links_used: set[int] = set()


_Job = tuple[_Tx, int, "asyncio.Future[list[Encoded]]"]


class TcpSender:
    """Sends transfers to one receiver over ``streams`` parallel connections."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        streams: int = DEFAULT_STREAMS,
        chunk_size: int | None = None,
        identity: str = "kvbridge-sender",
        compat_hash: int = 0,
        psk: bytes | None = None,
        ssl: _ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        expected_peer: str | None = None,
        connect_timeout: float = 10.0,
        handshake_timeout: float = 10.0,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 20.0,
        reconnect_timeout: float = 30.0,
        ack_timeout: float = 2.0,
        compression: str | CompressionPolicy = "auto",
        scheduler: str = "srpt",
        max_resends: int = 8,
        workers: int | None = None,
        description: PeerDescription | None = None,
    ) -> None:
        if streams < 1:
            raise InvalidArgument("streams must be >= 1")
        limit = DEFAULT_MAX_FRAME - DATA_OVERHEAD
        if chunk_size is not None and not 0 < chunk_size <= limit:
            raise InvalidArgument(f"chunk_size must be in (0, {limit}]")
        for name, v in (
            ("connect_timeout", connect_timeout),
            ("handshake_timeout", handshake_timeout),
            ("reconnect_timeout", reconnect_timeout),
            ("ack_timeout", ack_timeout),
        ):
            if not (v > 0 and math.isfinite(v)):
                raise InvalidArgument(f"{name} must be a positive number of seconds")
        # None: fitted to the link per transfer (see _fit_chunk), at most DEFAULT_CHUNK
        self.auto_chunk = chunk_size is None
        chunk_size = DEFAULT_CHUNK if chunk_size is None else chunk_size
        self.host, self.port = host, port
        self.streams = streams
        self.chunk_size = chunk_size
        self.identity = identity
        self.compat_hash = compat_hash
        self.description = description  # sent in HELLO (docs/protocol.md 4.7)
        self.psk = psk
        self.expected_peer = expected_peer
        self.reconnect_timeout = reconnect_timeout
        self.max_resends = max_resends
        self.policy = (
            compression
            if isinstance(compression, CompressionPolicy)
            else CompressionPolicy(compression)
        )
        self.scheduler = ChunkScheduler(scheduler)
        self._pool = ThreadPoolExecutor(
            max_workers=workers or max(2, min(streams, os.cpu_count() or 2)),
            thread_name_prefix="kvb-tx",
        )
        self._prep = Preparer(self._pool, self.policy)
        self._clock = AckClock(ack_timeout)
        self._links = LinkPool(
            host,
            port,
            streams,
            handshake=self._handshake,
            ssl=ssl,
            server_hostname=server_hostname,
            connect_timeout=connect_timeout,
            handshake_timeout=handshake_timeout,
            keepalive_interval=keepalive_interval,
            keepalive_timeout=keepalive_timeout,
            reconnect_timeout=reconnect_timeout,
            write_high=max(1 << 20, chunk_size),
            on_up=self._on_up,
            on_lost=self._on_lost,
            on_message=self._on_message,
            on_fatal=self._on_fatal,
            busy=lambda: bool(self._active),
        )
        self._active: set[_Tx] = set()
        self._rr = 0  # where _send_inline starts looking for an idle connection
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._control: dict[int, Callable[[FrameConnection, int, bytes], None]] = {}
        self.stats = self._links.stats  # connects, reconnects, connection_losses
        # named in every OPEN: the receiver binds a transfer to the sender
        # whose OPEN it took first and refuses another live one (docs/protocol.md 5.1)
        self.source_id = os.urandom(SOURCE_SIZE)

    def _handshake(self) -> ClientHandshake:
        return ClientHandshake(
            self.identity,
            self.compat_hash,
            psk=self.psk,
            expected_peer=self.expected_peer,
            capabilities=ALL_CAPABILITIES,
            description=self.description,
        )

    # ---- connections ---------------------------------------------------------------------
    async def connect(self) -> TcpSender:
        """Open the connections (idempotent).  Raises the handshake's typed
        error, ConnectTimeout or PeerGone if not one connection succeeds."""
        await self._links.connect()
        return self

    @property
    def live_streams(self) -> int:
        return len(self._links.live)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _on_up(self, link: Link) -> None:
        link.writer = asyncio.get_running_loop().create_task(self._writer(link))
        now, live = self._now(), len(self._links.live)
        for t in list(self._active):
            t.links_changed(live, now)
            self._kick(t)
            self._arm(t)

    def _on_lost(self, link: Link, err: KVBridgeError | None) -> None:
        if link.writer is not None:
            link.writer.cancel()
        now, live = self._now(), len(self._links.live)
        for t in list(self._active):
            outs = t.link_lost(link, now)
            t.links_changed(live, now)
            self._apply(t, outs)
            self._kick(t)
        link.rules.clear()
        self.scheduler.wake()

    def _on_fatal(self, err: KVBridgeError) -> None:
        """Reconnecting was refused for good and no connection is left."""
        for t in list(self._active):
            self._apply(t, t.fail(err))

    # ---- engine API ----------------------------------------------------------------------
    def send(
        self,
        request_id: str,
        source: Source,
        *,
        token: bytes,
        priority: int = 0,
        timeout: float | None = None,
        compression: str | None = None,
    ) -> SendHandle:
        """Start sending ``source`` for ``request_id`` with the receiver's
        transfer ``token``.  ``priority`` (0-255, higher first) beats the
        shortest-remaining-first order; ``timeout`` bounds the whole transfer
        (None: ``DEFAULT_TRANSFER_TIMEOUT``, 60 s)."""
        if not is_source(source):
            raise InvalidArgument(
                "source must provide nbytes, itemsize, layout_hash, ranges, read_into"
            )
        if len(token) != TOKEN_SIZE:
            raise InvalidArgument(f"token must be {TOKEN_SIZE} bytes")
        if not 0 <= priority <= 255:
            raise InvalidArgument("priority must be in [0, 255]")
        seconds = transfer_timeout(timeout)
        if self._closing:
            raise PeerGone("sender is closed")
        loop = asyncio.get_running_loop()
        now = loop.time()
        holder: list[_Tx] = []
        handle = SendHandle(
            request_id,
            source.nbytes,
            lambda reason: self._apply(
                holder[0], holder[0].cancel(Cancelled(reason), ErrorCode.CANCELLED)
            ),
        )
        ready = getattr(source, "ready_bytes", None)
        t = _Tx(
            handle,
            source,
            compression,
            request_id=request_id,
            token=bytes(token),
            total=source.nbytes,
            layout_hash=source.layout_hash,
            token_range=tuple(source.token_range),
            layer_range=tuple(source.layer_range),
            priority=priority,
            deadline=now + seconds,
            now=now,
            clock=self._clock,
            limits=TxLimits(
                max_resends=self.max_resends,
                reconnect_timeout=self.reconnect_timeout,
                ready_timeout=getattr(source, "ready_timeout", None),
            ),
            ready_bytes=None if ready is None else int(ready),
            planned_chunk=self.chunk_size,
            link_clock=_clock_of,
            source_id=self.source_id,
        )
        handle._transfer = t
        holder.append(t)
        if ready is not None:  # a layer-wise source: told when more bytes are ready
            source.on_ready(lambda: loop.call_soon_threadsafe(self._ready_changed, t))  # type: ignore[attr-defined]
        t.links_changed(len(self._links.live), now)
        self._active.add(t)
        if self._links.connected:
            # no task: connected already.  Not from this call either: a
            # cancel right after send() still stops it before anything went out
            loop.call_soon(self._begin_soon, t)
            self._links.ensure()
        else:
            self._arm(t)  # its deadline runs while it waits for a connection
            task = loop.create_task(self._start(t))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return handle

    async def _start(self, t: _Tx) -> None:
        try:
            await self.connect()
        except KVBridgeError as e:
            self._apply(t, t.fail(e))
            return
        self._begin_soon(t)

    def _begin_soon(self, t: _Tx) -> None:
        if t.finished:  # cancelled (or failed) before it began
            if t.unopened_abort is not None:
                self._abort_unopened(t)
            return
        self._begin_transfer(t)  # arms its timer

    def _begin_transfer(self, t: _Tx) -> None:
        """Connected: fix the chunk grid, send what can go at once, queue the rest."""
        # a receiver may accept smaller frames than our chunk size
        chunk = min(self._fit_chunk(), self._links.peer_max_frame - DATA_OVERHEAD)
        t.stats.chunk_size = chunk
        # its Wake: scheduler.add below wakes the writers
        t.start(chunk, self._now(), early_bytes=self._early_bytes(chunk))
        self._send_inline(t)
        # OPEN at once on one connection: the receiver checks the token now,
        # and a cancel reaches it even before the first chunk is ready
        self._kick(t)
        if not t.finished:
            self.scheduler.add(t)
        self._arm(t)

    def _send_inline(self, t: _Tx) -> None:
        """Send chunks of a new transfer from this call, each with its OPEN in
        one write, on connections whose writer is idle, when nothing else
        waits to be sent and the chunks are prepared on the loop (raw, small,
        from a source that gives them without blocking)."""
        first = [(0, min(t.chunk_size, t.total))]  # no chunk is larger
        if not self.scheduler.idle() or not self._prep.inline(t, first, self._links.peer_caps):
            return
        live = self._links.live
        self._rr += 1  # successive small transfers start on successive connections
        for i in range(len(live)):
            link = live[(self._rr + i) % len(live)]
            if not t.has_pending():
                return
            if not link.idle or link.conn.write_buffer_size:
                continue
            idx = t.pop_pending()
            pieces = t.pieces(idx, link.ranged)
            if not pieces:
                continue
            t.claim(link, idx)
            try:
                bodies = self._prep.encode(t, pieces)
            except Exception as e:
                self._source_failed(t, e)
                return
            if not self._write(link, t, idx, bodies):
                self._apply(t, t.unclaim(link, idx))

    def _early_bytes(self, chunk: int) -> int:
        """What a new transfer may send before the receiver's first RESUME
        (which says what it holds already): one chunk per connection (each
        leaves with its OPEN, in one write), or more when the connections
        carry more in one round trip (their measured rates times the
        measured ACK delay), so that a fresh transfer never waits for RESUME
        while a link could be busy.  A transfer sent again (a restarted
        sender, a repeated ticket) repeats at most that much; the receiver
        drops the bytes it holds."""
        live = self._links.live
        bdp = 0.0
        srtt = self._clock.srtt
        if srtt is not None:
            bdp = sum((lk.clock.rate or 0.0) * srtt for lk in live)
        return max(chunk * max(1, len(live)), int(bdp))

    def _fit_chunk(self) -> int:
        """The chunk size for a new transfer.  Fixed when one was configured;
        else the largest multiple of 256 KiB (at least 256 KiB, at most 4 MiB)
        that one stream moves in about CHUNK_SECONDS at the link rate
        (configured, or measured on earlier transfers; unknown: 4 MiB).  Small
        chunks on a slow link keep the last chunks from straggling on one
        stream and a small transfer from waiting long behind a large one; large
        chunks on a fast link keep the per-chunk costs down."""
        link = self.policy.link_Bps or self.policy.measured_link_Bps
        if not self.auto_chunk or not link:
            return self.chunk_size
        per_stream = link / max(1, self.streams)
        fit = int(per_stream * CHUNK_SECONDS) // MIN_AUTO_CHUNK * MIN_AUTO_CHUNK
        return max(MIN_AUTO_CHUNK, min(self.chunk_size, fit))

    def _ready_changed(self, t: _Tx) -> None:
        if not t.finished:
            self._apply(t, t.set_ready(int(t.source.ready_bytes), self._now()))  # type: ignore[attr-defined]

    def send_control(self, type: int, payload: bytes, flags: int = 0) -> None:
        """Send a CONTROL frame on one live connection."""
        for link in self._links.live:
            link.conn.send_control(type, payload, flags)
            return
        raise PeerGone("no live connection")

    def on_control(self, type: int, handler: Callable[[FrameConnection, int, bytes], None]) -> None:
        self._control[type] = handler

    async def close(self) -> None:
        self._closing = True
        for t in list(self._active):
            self._apply(t, t.cancel(Cancelled("sender closed"), ErrorCode.SHUTDOWN))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._links.close()
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> TcpSender:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- carrying out what the transfers decide ------------------------------------------
    def _apply(self, t: _Tx, outs: list[TxOutput[Link]]) -> None:
        for o in outs:
            if isinstance(o, Wake):
                self.scheduler.wake()
            elif isinstance(o, SendAbort):
                if not o.link.closed:
                    with contextlib.suppress(KVBridgeError):
                        o.link.conn.send(o.message)
            elif isinstance(o, AbortUnopened):
                self._abort_unopened(t)  # else _start sends it once connected
            elif isinstance(o, Finished):
                self._finished(t, o.error)
        self._arm(t)

    def _arm(self, t: _Tx) -> None:
        """One timer per transfer, at or before its next deadline."""
        d = t.next_deadline
        if d is None:
            if t.timer is not None:
                t.timer.cancel()
                t.timer, t.timer_at = None, math.inf
            return
        if t.timer is not None and t.timer_at <= d:
            return  # fires first; it re-arms
        if t.timer is not None:
            t.timer.cancel()
        t.timer = asyncio.get_running_loop().call_at(d, self._on_timer, t)
        t.timer_at = d

    def _on_timer(self, t: _Tx) -> None:
        t.timer, t.timer_at = None, math.inf
        self._apply(t, t.poll(self._now()))

    def _finished(self, t: _Tx, error: KVBridgeError | None) -> None:
        self._active.discard(t)
        self.scheduler.remove(t)
        if t.timer is not None:
            t.timer.cancel()
            t.timer, t.timer_at = None, math.inf
        for link, tid in t.tids:
            link.rules.forget(tid)
        st = t.stats
        st.retries, st.chunks = t.retries, t.chunks_sent
        if error is None:
            st.seconds = time.perf_counter() - t.handle._t0
            self.policy.observe_goodput(t.total, st.seconds)
        t.handle._resolve(error)

    def _open_on(self, link: Link, t: _Tx) -> int:
        tid = t.opened.get(link)
        if tid is not None:
            return tid
        tid = link.rules.new_tid()
        link.conn.send(t.open_message(tid, self._links.peer_caps & CODEC_CAPABILITIES))
        t.attach(link, tid)
        link.rules.bind(tid, t)
        t.tids.append((link, tid))
        return tid

    def _kick(self, t: _Tx) -> None:
        """A running transfer must be open on a live connection, so that the
        receiver's RESUME and COMPLETE can reach us (and it learns early of
        the transfer)."""
        if t.finished or t.grid is None or any(not lk.closed for lk in t.opened):
            return
        for link in self._links.live:
            with contextlib.suppress(KVBridgeError):
                self._open_on(link, t)
            return

    def _abort_unopened(self, t: _Tx) -> bool:
        """A transfer that ended before its OPEN went out: OPEN and ABORT it on
        one live connection, so that the receiver's expectation fails now
        instead of at its own deadline (replies to that id are ignored).
        False when no connection is live yet."""
        if t.unopened_abort is None:
            return True
        code, reason = t.unopened_abort
        for link in self._links.live:
            tid = link.new_tid()
            with contextlib.suppress(KVBridgeError):
                link.conn.send(t.open_message(tid, self._links.peer_caps & CODEC_CAPABILITIES))
                link.conn.send(Abort(tid, code, reason))
            t.unopened_abort = None
            return True
        return False

    # ---- writing -------------------------------------------------------------------------
    def _begin(self, link: Link, t: _Tx, idx: int) -> _Job | None:
        """Claim chunk ``idx`` for ``link`` and start preparing it (at once,
        on the loop, when that is cheaper than a worker thread)."""
        pieces = t.pieces(idx, link.ranged)
        if not pieces:
            return None
        t.claim(link, idx)
        caps = self._links.peer_caps
        fut: asyncio.Future[list[Encoded]]
        if self._prep.inline(t, pieces, caps):
            fut = asyncio.get_running_loop().create_future()
            try:
                fut.set_result(self._prep.encode(t, pieces))
            except Exception as e:
                fut.set_exception(e)
        else:
            fut = asyncio.ensure_future(self._prep.prepare(t, pieces, caps))
        fut.add_done_callback(_retrieve)
        return t, idx, fut

    def _source_failed(self, t: _Tx, e: BaseException) -> None:
        err = e if isinstance(e, KVBridgeError) else KVBridgeError(f"source failed: {e!r}")
        self._apply(t, t.cancel(err, ErrorCode.SOURCE_ERROR))

    def _write(self, link: Link, t: _Tx, idx: int, bodies: list[Encoded]) -> bool:
        """Write chunk ``idx``'s DATA frames on ``link`` (with the transfer's
        OPEN first, in the same write, if it is not open there yet).  False
        when the connection refused them (the caller gives the chunk back)."""
        conn = link.conn
        d = t.decision
        assert d is not None
        conn.cork()
        try:
            tid = self._open_on(link, t)
            for off, raw_n, wire, ck in bodies:
                conn.send(
                    Data(tid, idx, off, raw_n, d.codec, d.shuffle, ck, wire,
                         head_check=link.ranged)
                )  # fmt: skip
        except KVBridgeError:
            return False
        finally:
            conn.uncork()
        t.sent(link, idx, len(bodies), self._now(), sum(b[1] for b in bodies))
        st = t.stats
        st.wire_bytes += sum(len(b[2]) for b in bodies)
        t.links_used.add(id(link))
        st.streams = len(t.links_used)
        return True

    def _plenty_left(self) -> bool:
        n = len(self._links.links)
        for t in self._active:
            n -= t.pending_chunks
            if n < 0:
                return True
        return False

    def _unclaim(self, link: Link, job: _Job) -> None:
        t, idx, fut = job
        fut.cancel()
        self._apply(t, t.unclaim(link, idx))

    async def _writer(self, link: Link) -> None:
        """Send chunks on one connection.  The next chunk is picked and
        prepared (packed, compressed, checksummed) while the previous one
        drains, so the socket never waits for the CPU work."""
        conn = link.conn
        ahead: _Job | None = None
        try:
            while not conn.closed:
                if ahead is None:
                    link.idle = True
                    try:
                        got, idx = await self.scheduler.next()
                    finally:
                        link.idle = False
                    assert isinstance(got, _Tx)
                    ahead = self._begin(link, got, idx)
                    if ahead is None:
                        continue
                job, ahead = ahead, None
                t, idx, fut = job
                try:
                    bodies = await fut
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self._source_failed(t, e)
                    continue
                if not t.owns(link, idx):
                    continue  # finished, confirmed meanwhile, or sent again elsewhere
                if conn.closed or not self._write(link, t, idx, bodies):
                    self._unclaim(link, job)
                    return
                self._arm(t)
                # the next chunk, unless the work is nearly done: then the last
                # chunks go to whichever connection frees up first (no tail
                # waiting behind a connection that was handed two of them)
                pick = self.scheduler.pick() if self._plenty_left() else None
                if pick is not None:
                    nt, nidx = pick
                    assert isinstance(nt, _Tx)
                    ahead = self._begin(link, nt, nidx)
                try:
                    await conn.drain()
                except KVBridgeError:
                    return
        finally:
            if ahead is not None:
                self._unclaim(link, ahead)

    # ---- frames from the receiver --------------------------------------------------------
    def _on_message(self, link: Link, m: Message) -> None:
        now = self._now()
        for o in link.rules.receive(m):
            if isinstance(o, Deliver):
                t = o.transfer
                if not t.finished:
                    self._apply(t, t.on_message(link, o.message, now))
            elif isinstance(o, ToControl):
                c = o.message
                h = self._control.get(c.type)
                if h is not None:
                    h(link.conn, c.type, c.payload)
            elif isinstance(o, Close):
                link.conn.fail(o.error, send_error=o.send_error)
                return
        if isinstance(m, REPLIES):
            # after: an ACK's wait is measured from the previous reply
            link.clock.on_reply(sum(n for _, n in m.ranges) if isinstance(m, Ack) else 0, now)


def _clock_of(link: Link) -> LinkClock:
    return link.clock


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """An abandoned preparation's error is not worth a warning."""
    if not fut.cancelled():
        fut.exception()
