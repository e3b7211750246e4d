"""The receiving side: listens, checks every chunk, writes it into its sink.

An engine calls :meth:`TcpReceiver.expect` for each request whose KV it
awaits; the returned :class:`ExpectHandle` carries the 16-byte transfer token
that the sender must present (the engine passes it to the sender through its
own control path).  Data for any other token is refused.  Each verified chunk
is written straight into the sink (any order, each byte once); the handle
resolves only when every byte is written and flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import ssl as _ssl
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ...errors import (
    AuthenticationError,
    Cancelled,
    ChecksumError,
    DecompressError,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    PeerGone,
    RemoteProtocolError,
    ResourceLimit,
    TransferAborted,
    TransferTimeout,
)
from ...wire.chunk import decode_chunk
from ...wire.description import PeerDescription
from ...wire.frames import (
    DATA_HEADER_SIZE,
    DEFAULT_MAX_FRAME,
    HEADER_SIZE,
    TOKEN_SIZE,
    Abort,
    Ack,
    ChunkCodec,
    Complete,
    Control,
    Data,
    DataHead,
    ErrorCode,
    Message,
    Nack,
    Open,
    Resume,
)
from ...wire.grid import ChunkGrid
from ...wire.handshake import PeerInfo, ServerHandshake
from ..handle import TransferHandleBase
from .bufpool import BufferPool
from .conn import FrameConnection, serve_handshake
from .kvio import Sink

log = logging.getLogger("kvbridge.transport")

__all__ = ["ExpectHandle", "ReceiverLimits", "TcpReceiver"]

INLINE_BYTES = 256 << 10  # raw chunks up to this size are written on the event loop
ControlHandler = Callable[[FrameConnection, int, bytes], None]


@dataclass(frozen=True)
class ReceiverLimits:
    """Per-peer limits (a peer is one handshake identity)."""

    max_connections_per_peer: int = 64
    max_inflight_bytes_per_peer: int = 64 << 20
    max_frame: int = DEFAULT_MAX_FRAME
    max_transfers_per_connection: int = 4096
    max_unknown_tokens: int = 8  # per connection, then the connection is closed
    max_stray_frames: int = 4096  # DATA for transfers not open on the connection
    max_bad_chunks: int = 32  # per transfer, then it is aborted
    linger_s: float = 30.0  # a finished or aborted transfer still answers OPEN this long


def _abort_error(code: int, reason: str) -> KVBridgeError:
    """The typed error for an ABORT received from the peer."""
    if code == ErrorCode.UNKNOWN_TOKEN:
        return AuthenticationError(f"peer refused the transfer token: {reason}")
    if code == ErrorCode.TRANSFER_MISMATCH:
        return IncompatiblePeer(f"peer refused the transfer: {reason}")
    if code == ErrorCode.TIMEOUT:
        return TransferTimeout(f"peer's deadline passed: {reason}")
    if code == ErrorCode.RESOURCE_LIMIT:
        return ResourceLimit(f"peer limit: {reason}")
    return TransferAborted(reason, code)


class ExpectHandle(TransferHandleBase[int]):
    """One expected incoming transfer.  Awaitable (returns the byte count);
    ``token`` goes to the sender; ``progress`` is 0.0-1.0."""

    _what = "complete"
    _cancel_reason = "cancelled by the receiver"

    def __init__(self, request_id: str, sink: Sink, token: bytes, on_cancel: Callable[[str], None]):
        super().__init__(request_id, sink.nbytes, on_cancel)
        self.sink = sink
        self.token = token
        self.received_bytes = 0
        self.stats: dict[str, Any] = {"chunks": 0, "duplicates": 0, "bad_chunks": 0, "placed": 0}

    def _moved_bytes(self) -> int:
        return self.received_bytes

    def _result(self, seconds: float) -> int:
        self.stats["seconds"] = seconds
        return self.total_bytes


class _RxTransfer:
    def __init__(self, handle: ExpectHandle, request_id: str, sink: Sink) -> None:
        self.handle = handle
        self.request_id = request_id
        self.sink = sink
        self.grid: ChunkGrid | None = None
        self.held: set[int] = set()
        self.writing: dict[int, dict[FrameConnection, int]] = {}
        self.placing: dict[FrameConnection, int] = {}  # chunk being read into the sink
        self.attached: dict[FrameConnection, int] = {}
        self.finished = False
        self.complete = False
        self.priority = 0
        # token_start, token_end, layer_start, layer_end of the first OPEN
        self.ranges: tuple[int, int, int, int] | None = None
        self.timer: asyncio.TimerHandle | None = None


@dataclass
class _Peer:
    identity: str
    conns: set[FrameConnection] = field(default_factory=set)
    inflight: int = 0
    held: bool = False


class _ConnState:
    def __init__(self, peer: _Peer) -> None:
        self.peer = peer
        self.transfers: dict[int, _RxTransfer] = {}
        self.unknown_tokens = 0
        self.stray = 0


class TcpReceiver:
    """Listens for senders; writes the transfers it expects into their sinks."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        identity: str = "kvbridge-receiver",
        compat_hash: int = 0,
        psk: bytes | Mapping[str, bytes] | None = None,
        allowed_identities: frozenset[str] | None = None,
        ssl: _ssl.SSLContext | None = None,
        limits: ReceiverLimits = ReceiverLimits(),
        handshake_timeout: float = 10.0,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 20.0,
        workers: int | None = None,
        description: PeerDescription | None = None,
    ) -> None:
        self.host, self._port = host, port
        self.identity = identity
        self.compat_hash = compat_hash
        self.description = description  # sent in HELLO_ACK (docs/protocol.md 4.7)
        self.psk = psk
        self.allowed = allowed_identities
        self.ssl = ssl
        self.limits = limits
        self.handshake_timeout = handshake_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self._workers = workers or min(8, os.cpu_count() or 2)
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvb-rx")
        self._queue: list[tuple[int, int, int, tuple[Any, ...]]] = []
        self._closing = False
        self._seq = itertools.count()
        self._running = 0
        self._server: asyncio.Server | None = None
        self._expected: dict[bytes, _RxTransfer] = {}
        self._peers: dict[str, _Peer] = {}
        self._conns: dict[FrameConnection, _ConnState] = {}
        self._handshakes: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._control: dict[int, ControlHandler] = {}
        self._bufpool = BufferPool()
        self.stats: dict[str, int] = {"handshake_failures": 0, "unknown_tokens": 0}

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> TcpReceiver:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: FrameConnection(
                keepalive_interval=self.keepalive_interval,
                keepalive_timeout=self.keepalive_timeout,
                on_made=self._on_made,
                replies_only=True,
            ),
            self.host,
            self._port,
            ssl=self.ssl,
            ssl_handshake_timeout=self.handshake_timeout if self.ssl else None,
        )
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening, abort every unfinished transfer, close connections."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for t in list(self._expected.values()):
            self._finish(t, Cancelled("receiver closed"), ErrorCode.SHUTDOWN)
        for conn in list(self._conns):
            conn.close()
        while self._handshakes or self._tasks:
            pending = list(self._handshakes | self._tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._handshakes.difference_update(pending)
            self._tasks.difference_update(pending)
        for conn in list(self._conns):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(conn.wait_closed(), 2.0)
        if self._server is not None:
            await self._server.wait_closed()
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> TcpReceiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- engine API ----------------------------------------------------------------------
    def expect(self, request_id: str, sink: Sink, *, timeout: float | None = None) -> ExpectHandle:
        """Expect a transfer into ``sink``; returns the handle whose ``token`` the
        sender must present.  ``timeout`` bounds the whole transfer."""
        if not isinstance(sink, Sink):
            raise InvalidArgument("sink must provide nbytes, layout_hash, ranges, write and flush")
        token = os.urandom(TOKEN_SIZE)
        holder: list[_RxTransfer] = []
        handle = ExpectHandle(
            request_id,
            sink,
            token,
            lambda reason: self._finish(holder[0], Cancelled(reason), ErrorCode.CANCELLED, reason),
        )
        t = _RxTransfer(handle, request_id, sink)
        holder.append(t)
        self._expected[token] = t
        if timeout is not None:
            t.timer = asyncio.get_running_loop().call_later(
                timeout,
                lambda: self._finish(
                    t,
                    TransferTimeout(f"transfer {request_id!r} not complete after {timeout} s"),
                    ErrorCode.TIMEOUT,
                ),
            )
        return handle

    def on_control(self, type: int, handler: ControlHandler) -> None:
        """Deliver CONTROL frames of ``type`` to ``handler(conn, type, payload)``;
        the handler may answer with ``conn.send_control``."""
        self._control[type] = handler

    def send_control(self, identity: str, type: int, payload: bytes, flags: int = 0) -> None:
        """Send a CONTROL frame to the connected sender that authenticated as
        ``identity`` (on one of its live connections)."""
        peer = self._peers.get(identity)
        for conn in sorted(peer.conns, key=id) if peer is not None else ():
            if not conn.closed:
                conn.send_control(type, payload, flags)
                return
        raise PeerGone(f"no live connection from {identity!r}")

    def peer_identities(self) -> list[str]:
        """Identities of the senders that are connected now."""
        return [i for i, p in self._peers.items() if any(not c.closed for c in p.conns)]

    @property
    def inflight_bytes(self) -> int:
        return sum(p.inflight for p in self._peers.values())

    @property
    def active_transfers(self) -> int:
        return sum(1 for t in self._expected.values() if not t.finished)

    # ---- connections ---------------------------------------------------------------------
    def _on_made(self, conn: FrameConnection) -> None:
        conn.decoder.allocate = self._bufpool.get
        conn.decoder.place = lambda head: self._place(conn, head)
        task = asyncio.get_running_loop().create_task(self._handshake(conn))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: FrameConnection) -> None:
        def admit(identity: str) -> None:
            peer = self._peers.setdefault(identity, _Peer(identity))
            if len(peer.conns) >= self.limits.max_connections_per_peer:
                raise ResourceLimit(
                    f"peer {identity!r} already has {len(peer.conns)} connections (the limit)"
                )
            peer.conns.add(conn)
            self._conns[conn] = _ConnState(peer)
            conn.on_close.append(self._on_closed)

        hs = ServerHandshake(
            self.identity,
            self.compat_hash,
            psk=self.psk,
            allowed_identities=self.allowed,
            max_frame=self.limits.max_frame,
            admit=admit,
            description=self.description,
        )
        try:
            peer: PeerInfo = await serve_handshake(conn, hs, self.handshake_timeout)
        except KVBridgeError as e:
            self.stats["handshake_failures"] += 1
            log.info("handshake from %s failed: %s", conn.peername, e)
            return
        if conn.closed:
            return
        conn.set_write_limits(1 << 20)
        conn.start(peer, self._on_message)

    def _on_closed(self, conn: FrameConnection, err: KVBridgeError | None) -> None:
        st = self._conns.pop(conn, None)
        if st is None:
            return
        st.peer.conns.discard(conn)
        for t in st.transfers.values():
            t.attached.pop(conn, None)
            idx = t.placing.pop(conn, None)
            if idx is not None:  # the chunk was cut off mid-frame: it is needed again
                self._renack(t, idx, ErrorCode.CHECKSUM)

    # ---- frames --------------------------------------------------------------------------
    def _on_message(self, conn: FrameConnection, m: Message) -> None:
        st = self._conns.get(conn)
        if st is None:
            return
        if isinstance(m, Data):
            self._on_data(conn, st, m)
        elif isinstance(m, Open):
            self._on_open(conn, st, m)
        elif isinstance(m, Abort):
            t = st.transfers.get(m.transfer_id)
            if t is not None:
                self._finish(t, _abort_error(m.code, m.reason), None)
        elif isinstance(m, Control):
            h = self._control.get(m.type)
            if h is None:
                log.debug("dropping CONTROL %#x: no handler", m.type)
            else:
                h(conn, m.type, m.payload)
        else:
            raise RemoteProtocolError(f"a sender may not send {type(m).__name__}")

    def _on_open(self, conn: FrameConnection, st: _ConnState, m: Open) -> None:
        if m.transfer_id in st.transfers:
            raise RemoteProtocolError(f"transfer id {m.transfer_id} reused on one connection")
        t = self._expected.get(m.token)
        if t is None:
            st.unknown_tokens += 1
            self.stats["unknown_tokens"] += 1
            conn.send(Abort(m.transfer_id, ErrorCode.UNKNOWN_TOKEN, "transfer token not issued"))
            if st.unknown_tokens > self.limits.max_unknown_tokens:
                raise AuthenticationError("too many transfer tokens that were never issued")
            return
        if t.finished and not t.complete:
            conn.send(Abort(m.transfer_id, ErrorCode.CANCELLED, "transfer no longer expected"))
            return
        if conn in t.attached and not t.complete:
            conn.send(
                Abort(
                    m.transfer_id,
                    ErrorCode.TRANSFER_MISMATCH,
                    f"transfer already open on this connection as id {t.attached[conn]}",
                )
            )
            return
        if len(st.transfers) >= self.limits.max_transfers_per_connection:
            conn.send(Abort(m.transfer_id, ErrorCode.RESOURCE_LIMIT, "too many open transfers"))
            return
        problem = self._mismatch(t, m)
        if problem:
            conn.send(Abort(m.transfer_id, ErrorCode.TRANSFER_MISMATCH, problem))
            if t.grid is None:
                self._finish(t, IncompatiblePeer(f"sender's OPEN does not fit: {problem}"), None)
            return
        if t.grid is None:
            t.grid = ChunkGrid(m.total_bytes, m.chunk_size)
            t.priority = m.priority
            t.ranges = (m.token_start, m.token_end, m.layer_start, m.layer_end)
        st.transfers[m.transfer_id] = t
        t.attached[conn] = m.transfer_id
        conn.send(Resume(m.transfer_id, t.grid.to_ranges(t.held)))
        if t.complete:
            conn.send(Complete(m.transfer_id, t.handle.total_bytes))
        elif t.grid.count == 0:
            self._maybe_complete(t)

    def _mismatch(self, t: _RxTransfer, m: Open) -> str:
        s = t.sink
        if m.request_id != t.request_id:
            return f"request id {m.request_id!r} != {t.request_id!r}"
        if m.total_bytes != s.nbytes:
            return f"total bytes {m.total_bytes} != {s.nbytes}"
        if m.layout_hash != s.layout_hash:
            return f"layout hash {m.layout_hash:#x} != {s.layout_hash:#x}"
        if s.token_range != (0, 0) and (m.token_start, m.token_end) != tuple(s.token_range):
            return f"token range [{m.token_start}, {m.token_end}) != {s.token_range}"
        if s.layer_range != (0, 0) and (m.layer_start, m.layer_end) != tuple(s.layer_range):
            return f"layer range [{m.layer_start}, {m.layer_end}) != {s.layer_range}"
        limit = self.limits.max_frame - DATA_HEADER_SIZE
        if not 0 < m.chunk_size <= limit:
            return f"chunk size {m.chunk_size} outside (0, {limit}]"
        if t.grid is not None and t.grid.chunk_size != m.chunk_size:
            return f"chunk size {m.chunk_size} != {t.grid.chunk_size} of the first OPEN"
        ranges = (m.token_start, m.token_end, m.layer_start, m.layer_end)
        if t.ranges is not None and ranges != t.ranges:
            return f"token and layer ranges {ranges} != {t.ranges} of the first OPEN"
        return ""

    def _place(self, conn: FrameConnection, h: DataHead) -> memoryview | None:
        """Where the bytes of an incoming DATA frame should land: straight in
        the sink when the chunk is uncompressed, expected, not yet held or
        being written, and the sink exposes its memory; else None."""
        st = self._conns.get(conn)
        if st is None or conn.peer is None or h.codec != ChunkCodec.RAW or h.shuffle:
            return None
        t = st.transfers.get(h.transfer_id)
        view = getattr(t.sink, "view", None) if t is not None else None
        if t is None or view is None or t.grid is None or t.finished or conn in t.placing:
            return None
        try:
            idx = t.grid.index_of(h.offset, h.raw_length)
        except RemoteProtocolError:
            return None  # _on_data rejects it
        if idx != h.seq or h.wire_length != h.raw_length or idx in t.held or idx in t.writing:
            return None
        try:
            out: memoryview = view(h.offset, h.raw_length)
            if len(out) != h.raw_length or out.readonly:
                raise InvalidArgument(f"sink.view gave {len(out)} bytes, readonly={out.readonly}")
        except Exception as e:
            err = e if isinstance(e, KVBridgeError) else KVBridgeError(f"sink.view failed: {e!r}")
            self._finish(t, err, ErrorCode.SINK_ERROR)
            return None
        t.writing[idx] = {conn: h.transfer_id}
        t.placing[conn] = idx
        return out

    def _renack(self, t: _RxTransfer, idx: int, code: int) -> None:
        """Chunk ``idx`` did not make it into the sink: every live connection
        that sent it (duplicates included) is asked for it again."""
        off, n = t.grid.span(idx) if t.grid is not None else (0, 0)
        for c, tid in t.writing.pop(idx, {}).items():
            if not c.closed:
                c.send(Nack(tid, off, n, code))

    def _damaged(self, t: _RxTransfer, idx: int, code: int) -> None:
        t.handle.stats["bad_chunks"] += 1
        self._renack(t, idx, code)
        if t.handle.stats["bad_chunks"] > self.limits.max_bad_chunks:
            self._finish(t, ChecksumError("too many damaged chunks"), ErrorCode.CHECKSUM)

    def _on_placed(self, conn: FrameConnection, t: _RxTransfer, m: Data) -> None:
        """A chunk that arrived straight in the sink: verify it, then hold it."""
        idx = t.placing.pop(conn, None)
        if idx is None or t.finished or idx != m.seq:
            return
        if m.digest != m.checksum:
            self._damaged(t, idx, ErrorCode.CHECKSUM)
            return
        t.handle.stats["placed"] += 1
        self._hold(t, idx, m)

    def _on_data(self, conn: FrameConnection, st: _ConnState, m: Data) -> None:
        t = st.transfers.get(m.transfer_id)
        if m.placed:
            if t is not None:
                self._on_placed(conn, t, m)
            return
        if t is None or t.grid is None:
            st.stray += 1
            if st.stray > self.limits.max_stray_frames:
                raise RemoteProtocolError("too many DATA frames for transfers not open here")
            return
        if t.finished and not t.complete:
            return
        idx = t.grid.index_of(m.offset, m.raw_length)
        if m.seq != idx:
            raise RemoteProtocolError(f"DATA seq {m.seq} does not match offset {m.offset}")
        if m.codec not in _CODECS or m.shuffle not in (0, 2):
            # a connection-level error (ERROR, close) for the connection that
            # sent it; the transfer lives on (protocol.md 4.5, 5.3)
            raise RemoteProtocolError(f"DATA with codec {m.codec}, shuffle {m.shuffle}")
        if idx in t.held:
            t.handle.stats["duplicates"] += 1
            conn.send(Ack(m.transfer_id, ((m.offset, m.raw_length),)))
            return
        if idx in t.writing:
            t.handle.stats["duplicates"] += 1
            t.writing[idx][conn] = m.transfer_id
            return
        t.writing[idx] = {conn: m.transfer_id}
        size = HEADER_SIZE + DATA_HEADER_SIZE + m.wire_length
        self._charge(st.peer, size)
        left = t.handle.total_bytes - t.handle.received_bytes
        heapq.heappush(
            self._queue, (-t.priority, left, next(self._seq), (t, idx, m, st.peer, size))
        )
        self._pump()

    def _pump(self) -> None:
        """Start queued writes, up to one per worker thread: the highest
        priority, then the transfer with the fewest bytes left, goes first, so
        that a small transfer is not queued behind a large one here either."""
        if self._closing:
            self._queue.clear()  # the transfers were failed by close()
            return
        while self._queue and self._running < self._workers:
            *_, job = heapq.heappop(self._queue)
            self._running += 1
            task = asyncio.get_running_loop().create_task(self._write(*job))
            self._tasks.add(task)
            task.add_done_callback(self._write_done)

    def _write_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._running -= 1
        self._pump()

    # ---- budget --------------------------------------------------------------------------
    def _charge(self, peer: _Peer, n: int) -> None:
        peer.inflight += n
        if not peer.held and peer.inflight > self.limits.max_inflight_bytes_per_peer:
            peer.held = True
            for c in peer.conns:
                c.hold_reading()

    def _refund(self, peer: _Peer, n: int) -> None:
        peer.inflight -= n
        if peer.held and peer.inflight <= self.limits.max_inflight_bytes_per_peer // 2:
            peer.held = False
            for c in peer.conns:
                c.release_reading()

    # ---- writing -------------------------------------------------------------------------
    async def _write(self, t: _RxTransfer, idx: int, m: Data, peer: _Peer, size: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            if m.codec == ChunkCodec.RAW and m.raw_length <= INLINE_BYTES:
                _decode_and_write(t.sink, m)  # cheaper than a hop to a worker thread
            else:
                await loop.run_in_executor(self._pool, _decode_and_write, t.sink, m)
        except ChecksumError as e:
            code = ErrorCode.DECOMPRESS if isinstance(e, DecompressError) else ErrorCode.CHECKSUM
            self._damaged(t, idx, code)
            return
        except RemoteProtocolError as e:  # not reached: _on_data checks codec and shuffle
            for c in t.writing.pop(idx, {}):
                c.fail(e)
            return
        except Exception as e:
            t.writing.pop(idx, None)
            err = e if isinstance(e, KVBridgeError) else KVBridgeError(f"sink failed: {e!r}")
            self._finish(t, err, ErrorCode.SINK_ERROR)
            return
        finally:
            self._refund(peer, size)
            if isinstance(m.data, memoryview) and not m.placed:
                self._bufpool.put(m.data.obj)
        self._hold(t, idx, m)

    def _hold(self, t: _RxTransfer, idx: int, m: Data) -> None:
        """Chunk ``idx`` is verified and in the sink: acknowledge it."""
        waiters = t.writing.pop(idx, {})
        if t.finished:
            return
        t.held.add(idx)
        t.handle.received_bytes += m.raw_length
        t.handle.stats["chunks"] += 1
        for c, tid in waiters.items():
            if not c.closed:
                c.send(Ack(tid, ((m.offset, m.raw_length),)))
        assert t.grid is not None
        if len(t.held) == t.grid.count:
            self._maybe_complete(t)

    def _maybe_complete(self, t: _RxTransfer) -> None:
        task = asyncio.get_running_loop().create_task(self._maybe_complete_async(t))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _maybe_complete_async(self, t: _RxTransfer) -> None:
        if t.finished:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, t.sink.flush)
        except Exception as e:
            err = e if isinstance(e, KVBridgeError) else KVBridgeError(f"sink flush failed: {e!r}")
            self._finish(t, err, ErrorCode.SINK_ERROR)
            return
        if t.finished:
            return
        t.complete = True
        self._finish(t, None, None)
        for c, tid in list(t.attached.items()):
            if not c.closed:
                c.send(Complete(tid, t.handle.total_bytes))

    def _finish(
        self, t: _RxTransfer, exc: BaseException | None, code: int | None, reason: str = ""
    ) -> None:
        """End a transfer: resolve its handle, tell the sender (ABORT ``code``)."""
        if t.finished:
            return
        t.finished = True
        if t.timer is not None:
            t.timer.cancel()
        for c in t.placing:  # not one more byte into a sink that its owner may reuse now
            c.decoder.discard_current()
        t.placing.clear()
        t.handle._resolve(exc)
        if code is not None:
            for c, tid in list(t.attached.items()):
                if not c.closed:
                    c.send(Abort(tid, code, reason or str(exc)))
        if exc is not None:
            t.held.clear()
        # keep the record a while: a late OPEN learns the outcome (COMPLETE or ABORT)
        asyncio.get_running_loop().call_later(self.limits.linger_s, self._forget, t)

    def _forget(self, t: _RxTransfer) -> None:
        self._expected.pop(t.handle.token, None)
        for c, tid in list(t.attached.items()):
            st = self._conns.get(c)
            if st is not None:
                st.transfers.pop(tid, None)
        t.attached.clear()


_CODECS = frozenset(int(c) for c in ChunkCodec)


def _decode_and_write(sink: Sink, m: Data) -> None:
    raw = decode_chunk(m.data, m.raw_length, m.codec, m.shuffle, m.checksum, m.digest)
    sink.write(m.offset, raw)
