"""The sending side: N parallel connections, chunks striped across them.

Each connection has one writer task.  A writer asks the
:class:`~kvbridge.transport.tcp.scheduler.ChunkScheduler` for the next chunk of any
transfer, packs and compresses it in a worker thread (so chunk k+1 is being
prepared while chunk k drains from the socket buffer), and writes it.  Acked
chunks are done for good; chunks that were in flight on a connection that
dropped, or that the receiver reported damaged (NACK), go back to the queue and
are prepared again from the source, so no buffer is kept for resends.
Completion is reported only on the receiver's COMPLETE.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import ssl as _ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...errors import (
    AuthenticationError,
    Cancelled,
    ChecksumError,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    PeerGone,
    RemoteProtocolError,
    TransferTimeout,
    VersionMismatch,
)
from ...wire.chunk import encode_chunk
from ...wire.description import PeerDescription
from ...wire.frames import (
    ALL_CAPABILITIES,
    DATA_HEADER_SIZE,
    DEFAULT_MAX_FRAME,
    TOKEN_SIZE,
    Abort,
    Ack,
    Capability,
    ChunkCodec,
    Complete,
    Control,
    Data,
    ErrorCode,
    Message,
    Nack,
    Open,
    Resume,
)
from ...wire.grid import ChunkGrid
from ...wire.handshake import ClientHandshake
from ..handle import TransferHandleBase
from .compress import CompressionDecision, CompressionPolicy
from .conn import FrameConnection, connect
from .kvio import Source
from .receiver import _abort_error
from .scheduler import ChunkScheduler

log = logging.getLogger("kvbridge.transport")

__all__ = ["SendHandle", "SendStats", "TcpSender"]

DEFAULT_STREAMS = 4
DEFAULT_CHUNK = 4 << 20
MIN_AUTO_CHUNK = 256 << 10
CHUNK_SECONDS = 0.03  # auto chunk size: about this long on one stream at the measured rate
INLINE_BYTES = 1 << 20  # chunk work up to this size runs on the event loop
_FATAL_HANDSHAKE = (AuthenticationError, IncompatiblePeer, VersionMismatch)


@dataclass
class SendStats:
    bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    chunks_sent: int = 0
    retries: int = 0  # chunks sent again (NACK or a dropped connection)
    streams: int = 0  # connections that carried this transfer's data
    chunk_size: int = 0
    compression: dict[str, Any] = field(default_factory=dict)

    @property
    def goodput_Bps(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


class SendHandle(TransferHandleBase[SendStats]):
    """One outgoing transfer.  Awaitable (returns :class:`SendStats` once the
    receiver confirmed every byte); ``progress`` is the acknowledged fraction."""

    _what = "confirmed"
    _cancel_reason = "cancelled by the sender"

    def __init__(self, request_id: str, total: int, on_cancel: Callable[[str], None]) -> None:
        super().__init__(request_id, total, on_cancel)
        self.acked_bytes = 0
        self.stats = SendStats(bytes=total)

    def _moved_bytes(self) -> int:
        return self.acked_bytes

    def _result(self, seconds: float) -> SendStats:
        self.stats.seconds = seconds
        return self.stats


class _TxTransfer:
    _arrivals = itertools.count()

    def __init__(
        self,
        handle: SendHandle,
        source: Source,
        token: bytes,
        request_id: str,
        chunk: int,
        prio: int,
    ) -> None:
        self.handle = handle
        self.source = source
        self.token = token
        self.request_id = request_id
        self.priority = prio
        self.arrival = next(self._arrivals)
        self.set_chunk_size(chunk)
        self.acked: set[int] = set()
        self.inflight: dict[int, _Link] = {}
        self.resends: dict[int, int] = {}
        self.opened: dict[_Link, int] = {}
        self.links_used: set[int] = set()
        self.decision: CompressionDecision | None = None
        self.decide_lock = asyncio.Lock()
        self.finished = False
        self.mode: str | None = None
        self.timer: asyncio.TimerHandle | None = None
        # ended (cancel, deadline) before any OPEN went out: the ABORT to send
        self.unopened_abort: tuple[int, str] | None = None

    def set_chunk_size(self, chunk: int) -> None:
        """Fix the chunk grid (before the first OPEN)."""
        self.grid = ChunkGrid(self.source.nbytes, chunk)
        self._heap = list(range(self.grid.count))
        self._pending = set(self._heap)

    # Schedulable
    @property
    def unsent_bytes(self) -> int:
        return len(self._pending) * self.grid.chunk_size

    def has_pending(self) -> bool:
        return bool(self._pending) and not self.finished

    @property
    def pending_chunks(self) -> int:
        return 0 if self.finished else len(self._pending)

    def pop_pending(self) -> int:
        while True:
            idx = heapq.heappop(self._heap)
            if idx in self._pending:
                self._pending.discard(idx)
                return idx

    def requeue(self, idx: int) -> None:
        if idx not in self.acked and idx not in self._pending and not self.finished:
            self._pending.add(idx)
            heapq.heappush(self._heap, idx)

    def drop_pending(self, idx: int) -> None:
        self._pending.discard(idx)

    @property
    def all_acked(self) -> bool:
        return len(self.acked) == self.grid.count


class _Link:
    def __init__(self, conn: FrameConnection) -> None:
        self.conn = conn
        self.tids: dict[int, _TxTransfer] = {}
        self.next_tid = itertools.count(1)
        self.writer: asyncio.Task[None] | None = None


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
        compression: str | CompressionPolicy = "auto",
        scheduler: str = "srpt",
        max_resends: int = 8,
        workers: int | None = None,
        description: PeerDescription | None = None,
    ) -> None:
        if streams < 1:
            raise InvalidArgument("streams must be >= 1")
        if chunk_size is not None and not 0 < chunk_size <= DEFAULT_MAX_FRAME - DATA_HEADER_SIZE:
            raise InvalidArgument(
                f"chunk_size must be in (0, {DEFAULT_MAX_FRAME - DATA_HEADER_SIZE}]"
            )
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
        self.ssl = ssl
        self.server_hostname = server_hostname
        self.expected_peer = expected_peer
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
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
        self._links: list[_Link] = []
        self._peer_caps = ALL_CAPABILITIES
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._active: set[_TxTransfer] = set()
        self._connect_lock = asyncio.Lock()
        self._connected = False
        self._closing = False
        self._reconnector: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._control: dict[int, Callable[[FrameConnection, int, bytes], None]] = {}
        self.stats: dict[str, int] = {"connects": 0, "reconnects": 0, "connection_losses": 0}

    # ---- connections ---------------------------------------------------------------------
    async def connect(self) -> TcpSender:
        """Open the connections (idempotent).  Raises the handshake's typed
        error, ConnectTimeout or PeerGone if not one connection succeeds."""
        async with self._connect_lock:
            if self._connected:
                return self
            deadline = time.monotonic() + self.connect_timeout
            delay = 0.02
            while True:
                results = await asyncio.gather(
                    *(self._open_link() for _ in range(self.streams - len(self._links))),
                    return_exceptions=True,
                )
                errors = [r for r in results if isinstance(r, BaseException)]
                if len(errors) < len(results) or self._links:
                    break
                fatal = [e for e in errors if isinstance(e, _FATAL_HANDSHAKE)]
                if fatal:
                    raise fatal[0]
                if time.monotonic() + delay > deadline or self._closing:
                    raise errors[0]
                await asyncio.sleep(delay)  # transient (refused, reset): retry until the deadline
                delay = min(2 * delay, 0.5)
            self._connected = True
            if errors:
                self._start_reconnector()
        return self

    async def _open_link(self) -> _Link:
        hs = ClientHandshake(
            self.identity,
            self.compat_hash,
            psk=self.psk,
            expected_peer=self.expected_peer,
            capabilities=ALL_CAPABILITIES,
            description=self.description,
        )
        conn = await connect(
            self.host,
            self.port,
            hs,
            ssl=self.ssl,
            server_hostname=self.server_hostname,
            connect_timeout=self.connect_timeout,
            handshake_timeout=self.handshake_timeout,
            keepalive_interval=self.keepalive_interval,
            keepalive_timeout=self.keepalive_timeout,
        )
        assert hs.peer is not None
        if self._closing:
            conn.close()
            raise PeerGone("sender closed")
        link = _Link(conn)
        self._peer_caps = hs.peer.capabilities
        self._peer_max_frame = hs.peer.max_frame
        conn.set_write_limits(max(1 << 20, self.chunk_size))
        conn.on_close.append(lambda c, e: self._on_link_lost(link, e))
        conn.start(hs.peer, lambda c, m: self._on_message(link, m))
        self._links.append(link)
        self.stats["connects"] += 1
        link.writer = asyncio.get_running_loop().create_task(self._writer(link))
        for t in list(self._active):
            self._kick(t)
        return link

    @property
    def live_streams(self) -> int:
        return sum(1 for link in self._links if not link.conn.closed)

    def _on_link_lost(self, link: _Link, err: KVBridgeError | None) -> None:
        if link in self._links:
            self._links.remove(link)
        if link.writer is not None:
            link.writer.cancel()
        self.stats["connection_losses"] += 1
        for t in list(self._active):
            t.opened.pop(link, None)
            for idx, lk in list(t.inflight.items()):
                if lk is link:
                    del t.inflight[idx]
                    if idx not in t.acked:
                        t.handle.stats.retries += 1
                        t.requeue(idx)
            self._kick(t)
        self.scheduler.wake()
        if not self._closing:
            log.info("connection lost (%s); %d left", err, self.live_streams)
            self._start_reconnector()

    def _start_reconnector(self) -> None:
        if self._reconnector is None or self._reconnector.done():
            self._reconnector = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        last: BaseException | None = None
        while not self._closing and len(self._links) < self.streams:
            if time.monotonic() > deadline:
                break
            try:
                await self._open_link()
                self.stats["reconnects"] += 1
                delay = 0.05
                continue
            except _FATAL_HANDSHAKE as e:
                last = e
                break
            except KVBridgeError as e:
                last = e
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        if not self._links and not self._closing:
            err = PeerGone(
                f"no connection to {self.host}:{self.port} could be re-established: {last}"
            )
            for t in list(self._active):
                self._finish(t, err, None)

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
        shortest-remaining-first order; ``timeout`` bounds the whole transfer."""
        if not isinstance(source, Source):
            raise InvalidArgument(
                "source must provide nbytes, itemsize, layout_hash, ranges, read_into"
            )
        if len(token) != TOKEN_SIZE:
            raise InvalidArgument(f"token must be {TOKEN_SIZE} bytes")
        if not 0 <= priority <= 255:
            raise InvalidArgument("priority must be in [0, 255]")
        if self._closing:
            raise PeerGone("sender is closed")
        holder: list[_TxTransfer] = []
        handle = SendHandle(
            request_id,
            source.nbytes,
            lambda reason: self._finish(holder[0], Cancelled(reason), ErrorCode.CANCELLED, reason),
        )
        t = _TxTransfer(handle, source, bytes(token), request_id, self.chunk_size, priority)
        t.mode = compression
        holder.append(t)
        self._active.add(t)
        loop = asyncio.get_running_loop()
        if timeout is not None:
            t.timer = loop.call_later(
                timeout,
                lambda: self._finish(
                    t,
                    TransferTimeout(f"transfer {request_id!r} not confirmed after {timeout} s"),
                    ErrorCode.TIMEOUT,
                ),
            )
        task = loop.create_task(self._start(t))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    async def _start(self, t: _TxTransfer) -> None:
        try:
            await self.connect()
        except KVBridgeError as e:
            self._finish(t, e, None)
            return
        if t.finished:
            if t.unopened_abort is not None:
                self._abort_unopened(t, *t.unopened_abort)
            return
        # a receiver may accept smaller frames than our chunk size
        chunk = min(self._fit_chunk(), self._peer_max_frame - DATA_HEADER_SIZE)
        t.handle.stats.chunk_size = chunk
        if chunk != t.grid.chunk_size:
            t.set_chunk_size(chunk)
        # OPEN at once on one connection: the receiver checks the token now,
        # and a cancel reaches it even before the first chunk is ready
        for link in self._links:
            if not link.conn.closed:
                with contextlib.suppress(KVBridgeError):
                    self._open_on(link, t)
                break
        self.scheduler.add(t)
        self._kick(t)

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

    def send_control(self, type: int, payload: bytes, flags: int = 0) -> None:
        """Send a CONTROL frame on one live connection."""
        for link in self._links:
            if not link.conn.closed:
                link.conn.send_control(type, payload, flags)
                return
        raise PeerGone("no live connection")

    def on_control(self, type: int, handler: Callable[[FrameConnection, int, bytes], None]) -> None:
        self._control[type] = handler

    async def close(self) -> None:
        self._closing = True
        for t in list(self._active):
            self._finish(t, Cancelled("sender closed"), ErrorCode.SHUTDOWN)
        if self._reconnector is not None:
            self._reconnector.cancel()
        for task in list(self._tasks):
            task.cancel()
        for link in list(self._links):
            if link.writer is not None:
                link.writer.cancel()
            link.conn.close()
        waits = [link.writer for link in self._links if link.writer is not None]
        await asyncio.gather(*waits, *self._tasks, return_exceptions=True)
        if self._reconnector is not None:
            await asyncio.gather(self._reconnector, return_exceptions=True)
        for link in list(self._links):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(link.conn.wait_closed(), 2.0)
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> TcpSender:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- writing -------------------------------------------------------------------------
    def _open_msg(self, t: _TxTransfer, tid: int) -> Open:
        s = t.source
        return Open(
            tid,
            t.token,
            s.layout_hash,
            s.nbytes,
            t.grid.chunk_size,
            s.token_range[0],
            s.token_range[1],
            s.layer_range[0],
            s.layer_range[1],
            self._peer_caps & ALL_CAPABILITIES,
            t.priority,
            t.request_id,
        )

    def _open_on(self, link: _Link, t: _TxTransfer) -> int:
        tid = t.opened.get(link)
        if tid is not None:
            return tid
        tid = next(link.next_tid)
        link.conn.send(self._open_msg(t, tid))
        t.opened[link] = tid
        link.tids[tid] = t
        return tid

    def _abort_unopened(self, t: _TxTransfer, code: int, reason: str) -> bool:
        """A transfer that ended before its OPEN went out: OPEN and ABORT it on
        one live connection, so that the receiver's expectation fails now
        instead of at its own deadline (replies to that id are ignored).
        False when no connection is live yet."""
        for link in self._links:
            if not link.conn.closed:
                tid = next(link.next_tid)
                with contextlib.suppress(KVBridgeError):
                    link.conn.send(self._open_msg(t, tid))
                    link.conn.send(Abort(tid, code, reason))
                return True
        return False

    def _kick(self, t: _TxTransfer) -> None:
        """A transfer with nothing left to send must still be open somewhere,
        so that the receiver's COMPLETE (or RESUME) can reach us."""
        if t.finished or t.has_pending() or t.inflight or t not in self.scheduler._items:
            return
        if any(not lk.conn.closed for lk in t.opened):
            return
        for link in self._links:
            if not link.conn.closed:
                with contextlib.suppress(KVBridgeError):
                    self._open_on(link, t)
                return

    def _begin(self, link: _Link, t: _TxTransfer, idx: int) -> _Job:
        """Claim chunk ``idx`` for ``link`` and start preparing it."""
        t.inflight[idx] = link
        fut = asyncio.ensure_future(self._prepare(t, idx))
        fut.add_done_callback(_retrieve)
        return t, idx, fut

    def _plenty_left(self) -> bool:
        n = len(self._links)
        for t in self._active:
            n -= t.pending_chunks
            if n < 0:
                return True
        return False

    def _unclaim(self, link: _Link, job: _Job) -> None:
        t, idx, fut = job
        fut.cancel()
        if t.inflight.get(idx) is link:
            del t.inflight[idx]
        t.requeue(idx)
        self.scheduler.wake()

    async def _writer(self, link: _Link) -> None:
        """Send chunks on one connection.  The next chunk is picked and
        prepared (packed, compressed, checksummed) while the previous one
        drains, so the socket never waits for the CPU work."""
        conn = link.conn
        ahead: _Job | None = None
        try:
            while not conn.closed:
                if ahead is None:
                    t, idx = await self.scheduler.next()
                    assert isinstance(t, _TxTransfer)
                    ahead = self._begin(link, t, idx)
                job, ahead = ahead, None
                t, idx, fut = job
                try:
                    wire, ck, raw_n = await fut
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    t.inflight.pop(idx, None)
                    err = (
                        e
                        if isinstance(e, KVBridgeError)
                        else KVBridgeError(f"source failed: {e!r}")
                    )
                    self._finish(t, err, ErrorCode.SOURCE_ERROR)
                    continue
                if t.finished or idx in t.acked or t.inflight.get(idx) is not link:
                    continue
                if conn.closed:
                    self._unclaim(link, job)
                    return
                assert t.decision is not None
                off = idx * t.grid.chunk_size
                try:
                    tid = self._open_on(link, t)
                    conn.send(
                        Data(tid, idx, off, raw_n, t.decision.codec, t.decision.shuffle, ck, wire)
                    )
                except KVBridgeError:
                    self._unclaim(link, job)
                    return
                st = t.handle.stats
                st.wire_bytes += len(wire)
                st.chunks_sent += 1
                t.links_used.add(id(link))
                st.streams = len(t.links_used)
                # the next chunk, unless the work is nearly done: then the last
                # chunks go to whichever connection frees up first (no tail
                # waiting behind a connection that was handed two of them)
                got = self.scheduler.pick() if self._plenty_left() else None
                if got is not None:
                    nt, nidx = got
                    assert isinstance(nt, _TxTransfer)
                    ahead = self._begin(link, nt, nidx)
                try:
                    await conn.drain()
                except KVBridgeError:
                    return
        finally:
            if ahead is not None:
                self._unclaim(link, ahead)

    async def _prepare(self, t: _TxTransfer, idx: int) -> tuple[Any, int, int]:
        loop = asyncio.get_running_loop()
        off, n = t.grid.span(idx)
        if t.decision is None:
            async with t.decide_lock:
                if t.decision is None:
                    raw = await loop.run_in_executor(self._pool, read_chunk, t.source, off, n)
                    d = await loop.run_in_executor(
                        self._pool,
                        self.policy.decide,
                        memoryview(raw),
                        t.source.itemsize,
                        t.grid.total,
                        t.mode,
                    )
                    d = _clamp(d, self._peer_caps)
                    t.decision = d
                    t.handle.stats.compression = d.as_dict()
                    wire, ck = await loop.run_in_executor(
                        self._pool, encode_chunk, memoryview(raw), d.codec, d.shuffle
                    )
                    return wire, ck, n
        d = t.decision
        if d.codec == ChunkCodec.RAW and n <= INLINE_BYTES and hasattr(t.source, "view"):
            # a checksum of a zero-copy view: cheaper than a hop to a worker thread
            return (*_read_and_encode(t.source, off, n, d.codec, d.shuffle), n)
        wire, ck = await loop.run_in_executor(
            self._pool, _read_and_encode, t.source, off, n, d.codec, d.shuffle
        )
        return wire, ck, n

    # ---- frames from the receiver --------------------------------------------------------
    def _on_message(self, link: _Link, m: Message) -> None:
        if isinstance(m, Control):
            h = self._control.get(m.type)
            if h is not None:
                h(link.conn, m.type, m.payload)
            return
        if not isinstance(m, Ack | Resume | Nack | Abort | Complete):
            raise RemoteProtocolError(f"a receiver may not send {type(m).__name__}")
        t = link.tids.get(m.transfer_id)
        if t is None or t.finished:
            return
        if isinstance(m, Ack):
            self._acked(t, t.grid.from_ranges(m.ranges))
        elif isinstance(m, Resume):
            self._acked(t, t.grid.from_ranges(m.held))
        elif isinstance(m, Nack):
            idx = t.grid.index_of(m.offset, m.length)
            if idx in t.acked:
                return
            if t.inflight.get(idx) is link:
                del t.inflight[idx]
            n = t.resends.get(idx, 0) + 1
            t.resends[idx] = n
            t.handle.stats.retries += 1
            if n > self.max_resends:
                self._finish(
                    t, ChecksumError(f"chunk {idx} damaged {n} times in a row"), ErrorCode.CHECKSUM
                )
                return
            t.requeue(idx)
            self.scheduler.wake()
        elif isinstance(m, Abort):
            self._finish(t, _abort_error(m.code, m.reason), None)
        elif isinstance(m, Complete):
            if m.total_bytes != t.grid.total:
                raise RemoteProtocolError(
                    f"COMPLETE for {m.total_bytes} bytes, sent {t.grid.total}"
                )
            t.handle.acked_bytes = t.grid.total
            self._finish(t, None, None)

    def _acked(self, t: _TxTransfer, chunks: set[int]) -> None:
        for idx in chunks:
            if idx in t.acked:
                continue
            t.acked.add(idx)
            t.drop_pending(idx)
            t.inflight.pop(idx, None)
            t.handle.acked_bytes += t.grid.span(idx)[1]

    def _finish(
        self, t: _TxTransfer, exc: BaseException | None, code: int | None, reason: str = ""
    ) -> None:
        if t.finished:
            return
        t.finished = True
        if t.timer is not None:
            t.timer.cancel()
        self._active.discard(t)
        self.scheduler.remove(t)
        if code is not None:
            told = False
            for link, tid in list(t.opened.items()):
                if not link.conn.closed:
                    with contextlib.suppress(KVBridgeError):
                        link.conn.send(Abort(tid, code, reason or str(exc)))
                        told = True
            why = reason or str(exc)
            # not opened yet, or its connections are gone; not connected yet:
            # _start sends it once connected
            if not told and not self._abort_unopened(t, code, why):
                t.unopened_abort = (code, why)
        for link, tid in list(t.opened.items()):
            link.tids.pop(tid, None)
        t.opened.clear()
        t.inflight.clear()
        if exc is None:
            t.handle.stats.seconds = time.perf_counter() - t.handle._t0
            self.policy.observe_goodput(t.grid.total, t.handle.stats.seconds)
        t.handle._resolve(exc)


_Job = tuple[_TxTransfer, int, "asyncio.Future[tuple[Any, int, int]]"]


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """An abandoned preparation's error is not worth a warning."""
    if not fut.cancelled():
        fut.exception()


def _clamp(d: CompressionDecision, caps: int) -> CompressionDecision:
    """Use only what the receiver announced in its HELLO_ACK."""
    need = {ChunkCodec.LZ4: Capability.LZ4, ChunkCodec.ZSTD: Capability.ZSTD}.get(
        ChunkCodec(d.codec), 0
    )
    if need and not caps & need:
        d.codec, d.reason = ChunkCodec.RAW, f"receiver lacks {ChunkCodec(d.codec).name}"
    if d.shuffle and (d.codec == ChunkCodec.RAW or not caps & Capability.SHUFFLE2):
        d.shuffle = 0
    return d


def read_chunk(source: Source, off: int, n: int) -> Any:
    """The bytes ``[off, off + n)`` of ``source``, copied as little as it allows."""
    view = getattr(source, "view", None)
    if view is not None:
        return view(off, n)  # bytes already in wire form: no copy
    read = getattr(source, "read", None)
    if read is not None:
        return read(off, n)  # a buffer the source filled: no zero-fill
    raw = bytearray(n)
    source.read_into(off, memoryview(raw))
    return raw


def _read_and_encode(source: Source, off: int, n: int, codec: int, shuffle: int) -> tuple[Any, int]:
    return encode_chunk(read_chunk(source, off, n), codec, shuffle)
