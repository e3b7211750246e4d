"""The receiving side: listens, checks every chunk, writes it into its sink.

An engine calls :meth:`TcpReceiver.expect` for each request whose KV it
awaits; the returned :class:`ExpectHandle` carries the 16-byte transfer token
that the sender must present (the engine passes it to the sender through its
own control path).  Data for any other token is refused.

:class:`TcpReceiver` is a thin driver.  The rules of each transfer (which
OPEN fits, what RESUME says, where a chunk lands, acknowledgements, NACK,
ABORT, COMPLETE, deadline, linger) are the sans-IO
:class:`~kvbridge.wire.rxtransfer.RxTransfer`; the rules of each connection
(which frames a sender may send, transfer ids, unknown tokens, the transfer
limit, stray frames) are the sans-IO
:class:`~kvbridge.wire.connection.RxConnection`.  The driver owns the
listening socket, the handshakes, the per-peer budget (:mod:`.peers`) and
the write queue (:mod:`.writes`), and carries out what the state machines
return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl as _ssl
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...errors import (
    Cancelled,
    ErrorCode,
    InvalidArgument,
    KVBridgeError,
    PeerGone,
)
from ...wire.connection import (
    Admit,
    Close,
    ConnLimits,
    ConnOutput,
    Deliver,
    RxConnection,
    Send,
    ToControl,
)
from ...wire.description import PeerDescription
from ...wire.frames import (
    ALL_CAPABILITIES,
    DATA_HEADER_SIZE,
    HEADER_SIZE,
    TOKEN_SIZE,
    Abort,
    Capability,
    Data,
    DataHead,
    Error,
    Message,
    Open,
)
from ...wire.handshake import PeerInfo, ServerHandshake
from ...wire.rxtransfer import (
    Flush,
    Forget,
    Reply,
    Resolve,
    RxLimits,
    RxOutput,
    RxTransfer,
    StopPlacing,
    Write,
)
from ..handle import transfer_timeout
from .bufpool import BufferPool
from .conn import FrameConnection, serve_handshake
from .handles import ExpectHandle
from .identity import certificate_names, check_mode
from .kvio import Sink, is_sink
from .limits import ReceiverLimits
from .peers import Peer, PeerTable
from .writes import WriteQueue, decode_and_write, verifies_in_copy

log = logging.getLogger("kvbridge.transport")

__all__ = ["ExpectHandle", "ReceiverLimits", "TcpReceiver", "new_token"]


def new_token() -> bytes:
    """A fresh transfer token (16 random bytes) for :meth:`TcpReceiver.expect`."""
    return os.urandom(TOKEN_SIZE)


ControlHandler = Callable[[FrameConnection, int, bytes], None]
DEFAULT_LIMITS = ReceiverLimits()


class _Rx(RxTransfer[FrameConnection]):
    """A transfer's rules plus what the driver keeps beside them."""

    def __init__(self, handle: ExpectHandle, sink: Sink, **kw: Any) -> None:
        super().__init__(**kw)
        self.handle = handle
        self.sink = sink
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf


class _ConnState:
    """A connection's rules (:class:`RxConnection`) and its peer."""

    def __init__(self, peer: Peer, ranged: bool, limits: ConnLimits) -> None:
        self.peer = peer
        self.ranged = ranged
        self.rules: RxConnection[_Rx] = RxConnection(limits)


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
        tls_identity: str = "cn_or_san",
        limits: ReceiverLimits = DEFAULT_LIMITS,
        handshake_timeout: float = 10.0,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 20.0,
        workers: int | None = None,
        description: PeerDescription | None = None,
    ) -> None:
        if not (handshake_timeout > 0 and math.isfinite(handshake_timeout)):
            raise InvalidArgument("handshake_timeout must be a positive number of seconds")
        self.host, self._port = host, port
        self.identity = identity
        self.compat_hash = compat_hash
        self.description = description  # sent in HELLO_ACK (docs/protocol.md 4.7)
        self.psk = psk
        self.allowed = allowed_identities
        self.ssl = ssl
        self.tls_identity = check_mode(tls_identity)
        self.limits = limits
        self.handshake_timeout = handshake_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self._workers = workers or min(8, os.cpu_count() or 2)
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvb-rx")
        self._writes = WriteQueue(self._pool, self._workers)
        self._closing = False
        self._server: asyncio.Server | None = None
        self._expected: dict[bytes, _Rx] = {}
        # called on the loop when an OPEN names a token not expected (yet):
        # runs whatever expects are queued for this loop, then the token is
        # looked up again (SyncBridge hands out a ticket before its expect runs)
        self.token_miss: Callable[[], None] | None = None
        self._peers = PeerTable(limits)
        self._conns: dict[FrameConnection, _ConnState] = {}
        self._handshakes: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._control: dict[int, ControlHandler] = {}
        self._bufpool = BufferPool()
        self.stats: dict[str, int] = {
            "handshake_failures": 0,
            "handshakes_refused": 0,
            "unknown_tokens": 0,
            "source_conflicts": 0,  # OPENs refused: another sender is the live source (5.1)
            "takeovers": 0,  # OPENs that took over a transfer whose source was gone
        }

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
        if self._server is None:
            raise InvalidArgument("the receiver is not started: call start() first")
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening, abort every unfinished transfer, close connections."""
        self._closing = True
        self._writes.closing = True
        if self._server is not None:
            self._server.close()
        for t in list(self._expected.values()):
            self._apply(t, t.cancel(Cancelled("receiver closed"), ErrorCode.SHUTDOWN, self._now()))
        for t in list(self._expected.values()):
            if t.timer is not None:
                t.timer.cancel()
        for conn in list(self._conns):
            conn.close()
        while self._handshakes or self._tasks or self._writes.tasks:
            pending = list(self._handshakes | self._tasks | self._writes.tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._handshakes.difference_update(pending)
            self._tasks.difference_update(pending)
            self._writes.tasks.difference_update(pending)
        for conn in list(self._conns):
            try:
                await asyncio.wait_for(conn.wait_closed(), 2.0)
            except TimeoutError:
                conn.abort_transport()
        if self._server is not None:
            await self._server.wait_closed()
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> TcpReceiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- engine API ----------------------------------------------------------------------
    def expect(
        self,
        request_id: str,
        sink: Sink,
        *,
        timeout: float | None = None,
        token: bytes | None = None,
    ) -> ExpectHandle:
        """Expect a transfer into ``sink``; returns the handle whose ``token`` the
        sender must present.  ``timeout`` bounds the whole transfer (None:
        ``DEFAULT_TRANSFER_TIMEOUT``, 60 s).  ``token``: one drawn beforehand
        with :func:`new_token` (a caller that hands out the ticket before this
        call runs; see ``token_miss``); None draws one here."""
        if not is_sink(sink):
            raise InvalidArgument("sink must provide nbytes, layout_hash, ranges, write and flush")
        seconds = transfer_timeout(timeout)
        if token is None:
            token = new_token()
        elif len(token) != TOKEN_SIZE or token in self._expected:
            raise InvalidArgument(f"a transfer token is {TOKEN_SIZE} fresh random bytes")
        holder: list[_Rx] = []
        handle = ExpectHandle(
            request_id,
            sink,
            token,
            lambda reason: self._apply(
                holder[0],
                holder[0].cancel(Cancelled(reason), ErrorCode.CANCELLED, self._now()),
            ),
        )
        lim = self.limits
        t = _Rx(
            handle,
            sink,
            request_id=request_id,
            total=sink.nbytes,
            layout_hash=sink.layout_hash,
            token_range=tuple(sink.token_range),
            layer_range=tuple(sink.layer_range),
            deadline=self._now() + seconds,
            now=self._now(),
            limits=RxLimits(
                max_frame=lim.max_frame,
                max_bad_chunks=lim.max_bad_chunks,
                linger_s=lim.linger_s,
            ),
            can_place=getattr(sink, "view", None) is not None,
        )
        handle._transfer = t
        holder.append(t)
        self._expected[token] = t
        self._arm(t)
        return handle

    def on_control(self, type: int, handler: ControlHandler) -> None:
        """Deliver CONTROL frames of ``type`` to ``handler(conn, type, payload)``;
        the handler may answer with ``conn.send_control``."""
        self._control[type] = handler

    def send_control(self, identity: str, type: int, payload: bytes, flags: int = 0) -> None:
        """Send a CONTROL frame to the connected sender that authenticated as
        ``identity`` (on one of its live connections)."""
        peer = self._peers.peers.get(identity)
        for conn in sorted(peer.conns, key=id) if peer is not None else ():
            if not conn.closed:
                conn.send_control(type, payload, flags)
                return
        raise PeerGone(f"no live connection from {identity!r}")

    def peer_identities(self) -> list[str]:
        """Identities of the senders that are connected now."""
        return [i for i, p in self._peers.peers.items() if any(not c.closed for c in p.conns)]

    @property
    def inflight_bytes(self) -> int:
        return self._peers.inflight_bytes

    @property
    def active_transfers(self) -> int:
        return sum(1 for t in self._expected.values() if t.running)

    @property
    def pending_handshakes(self) -> int:
        return len(self._handshakes)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    # ---- connections ---------------------------------------------------------------------
    def _on_made(self, conn: FrameConnection) -> None:
        if self._closing or len(self._handshakes) >= self.limits.max_pending_handshakes:
            # nothing is kept for a connection that has not authenticated but
            # the connection itself, and only this many of those
            self.stats["handshakes_refused"] += 1
            with contextlib.suppress(KVBridgeError):
                conn.send(Error(ErrorCode.RESOURCE_LIMIT, "too many pending handshakes"))
            conn.close()
            return
        conn.decoder.allocate = self._bufpool.get
        conn.decoder.place = lambda head: self._place(conn, head)
        conn.decoder.hash_unplaced = lambda head: self._hash_unplaced(conn, head)
        task = asyncio.get_running_loop().create_task(self._handshake(conn))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: FrameConnection) -> None:
        admitted: list[Peer] = []

        def admit(identity: str) -> None:  # after AUTH: the peer is authenticated
            admitted.append(self._peers.admit(identity, conn))

        try:
            hs = ServerHandshake(
                self.identity,
                self.compat_hash,
                psk=self.psk,
                allowed_identities=self.allowed,
                max_frame=self.limits.max_frame,
                capabilities=ALL_CAPABILITIES,
                admit=admit,
                cert_names=self._cert_names(conn),
                description=self.description,
            )
            info: PeerInfo = await serve_handshake(conn, hs, self.handshake_timeout)
        except KVBridgeError as e:
            for peer in admitted:
                self._peers.release(peer, conn)
            self.stats["handshake_failures"] += 1
            log.info("handshake from %s failed: %s", conn.peername, e)
            return
        (peer,) = admitted
        if conn.closed:
            self._peers.release(peer, conn)
            return
        ranged = bool(info.capabilities & ALL_CAPABILITIES & Capability.RANGES)
        lim = self.limits
        self._conns[conn] = _ConnState(
            peer,
            ranged,
            ConnLimits(
                max_transfers=lim.max_transfers_per_connection,
                max_unknown_tokens=lim.max_unknown_tokens,
                max_stray_frames=lim.max_stray_frames,
            ),
        )
        conn.on_close.append(self._on_closed)
        conn.set_write_limits(1 << 20)
        conn.start(info, self._on_message)

    def _cert_names(self, conn: FrameConnection) -> frozenset[str] | None:
        if self.ssl is None or conn.transport is None:
            return None
        cert = conn.transport.get_extra_info("peercert")
        return certificate_names(cert, self.tls_identity)

    def _on_closed(self, conn: FrameConnection, err: KVBridgeError | None) -> None:
        st = self._conns.pop(conn, None)
        if st is None:
            return
        self._peers.release(st.peer, conn)
        now = self._now()
        for t in set(st.rules.transfers.values()):
            self._apply(t, t.conn_lost(conn, now))

    # ---- frames --------------------------------------------------------------------------
    def _on_message(self, conn: FrameConnection, m: Message) -> None:
        st = self._conns.get(conn)
        if st is None:
            return
        unknown = st.rules.unknown_tokens
        outs = st.rules.receive(m, self._find)
        self.stats["unknown_tokens"] += st.rules.unknown_tokens - unknown
        self._carry(conn, st, outs)

    def _find(self, token: bytes) -> _Rx | None:
        """The transfer an OPEN's token names.  A token not known yet may
        belong to an expectation whose ticket is out but whose ``expect`` is
        still queued for this loop (``token_miss`` runs that queue first)."""
        t = self._expected.get(token)
        if t is None and self.token_miss is not None:
            self.token_miss()
            t = self._expected.get(token)
        return t

    def _carry(self, conn: FrameConnection, st: _ConnState, outs: list[ConnOutput[_Rx]]) -> None:
        """Carry out what a connection's rules return."""
        for o in outs:
            if isinstance(o, Deliver):
                t, m = o.transfer, o.message
                if isinstance(m, Data):
                    self._apply(t, t.on_data(conn, m, self._now()), st.peer)
                elif isinstance(m, Abort):
                    self._apply(t, t.on_abort(conn, m, self._now()))
            elif isinstance(o, Admit):
                self._on_open(conn, st, o.transfer, o.message)
            elif isinstance(o, Send):
                conn.send(o.message)
            elif isinstance(o, Close):
                conn.fail(o.error, send_error=o.send_error)
                return
            elif isinstance(o, ToControl):
                c = o.message
                h = self._control.get(c.type)
                if h is None:
                    log.debug("dropping CONTROL %#x: no handler", c.type)
                else:
                    h(conn, c.type, c.payload)

    def _on_open(self, conn: FrameConnection, st: _ConnState, t: _Rx, m: Open) -> None:
        # the sender: its authenticated identity and the OPEN's source id (5.1)
        source = (st.peer.identity, m.source or None)
        seen = t.conflicts, t.takeovers
        outs = t.on_open(conn, m, st.ranged, self._now(), source)
        self.stats["source_conflicts"] += t.conflicts - seen[0]
        self.stats["takeovers"] += t.takeovers - seen[1]
        att = t.attached.get(conn)
        if att is not None and att.transfer_id == m.transfer_id:
            # a late OPEN of a finished one learns the outcome and lingers here too
            st.rules.attached(m.transfer_id, t, finished=t.finished)
        self._apply(t, outs)

    def _hash_unplaced(self, conn: FrameConnection, h: DataHead) -> bool:
        """Hash a frame's bytes as they arrive, unless its sink checks them
        in the pass that writes them (``write_checksummed``)."""
        st = self._conns.get(conn)
        t = st.rules.transfer(h.transfer_id) if st is not None else None
        return t is None or not verifies_in_copy(t.sink, h.codec, h.shuffle)

    def _place(self, conn: FrameConnection, h: DataHead) -> memoryview | None:
        """Where the bytes of an incoming DATA frame should land: straight in
        the sink when its transfer says so (raw, expected, none of its bytes
        held or being written) and the sink lends its memory; else None."""
        st = self._conns.get(conn)
        if st is None or conn.peer is None:
            return None
        t = st.rules.transfer(h.transfer_id)
        if t is None:
            return None
        job = t.place(conn, h)
        if job is None:
            return None
        try:
            out: memoryview = t.sink.view(h.offset, h.raw_length)  # type: ignore[attr-defined]
            if len(out) != h.raw_length or out.readonly:
                raise InvalidArgument(f"sink.view gave {len(out)} bytes, readonly={out.readonly}")
        except Exception as e:
            err = e if isinstance(e, KVBridgeError) else KVBridgeError(f"sink.view failed: {e!r}")
            self._apply(t, t.place_failed(conn, err, self._now()))
            return None
        return out

    # ---- carrying out what the transfers decide ------------------------------------------
    def _apply(
        self, t: _Rx, outs: list[RxOutput[FrameConnection]], peer: Peer | None = None
    ) -> None:
        """Carry out ``outs``; ``peer``: whose DATA frame they answer (its
        writes are charged to its budget)."""
        for o in outs:
            if isinstance(o, Reply):
                if not o.conn.closed:
                    with contextlib.suppress(KVBridgeError):
                        o.conn.send(o.message)
            elif isinstance(o, Write):
                self._queue_write(t, o, peer)
            elif isinstance(o, Flush):
                if getattr(t.sink, "flush_on_loop", False):
                    self._flush_now(t)  # cheap and never blocks: no thread hop
                else:
                    self._spawn(self._flush(t))
            elif isinstance(o, Resolve):
                t.handle._resolve(o.error)
                self._lingers(t)
            elif isinstance(o, StopPlacing):
                o.conn.decoder.discard_current()
            elif isinstance(o, Forget):
                self._forget(t)
        self._arm(t)

    def _arm(self, t: _Rx) -> None:
        d = t.next_deadline
        if d is None:
            if t.timer is not None:
                t.timer.cancel()
                t.timer, t.timer_at = None, math.inf
            return
        if t.timer is not None and t.timer_at <= d:
            return
        if t.timer is not None:
            t.timer.cancel()
        t.timer = asyncio.get_running_loop().call_at(d, self._on_timer, t)
        t.timer_at = d

    def _on_timer(self, t: _Rx) -> None:
        t.timer, t.timer_at = None, math.inf
        self._apply(t, t.poll(self._now()))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget(self, t: _Rx) -> None:
        if self._expected.get(t.handle.token) is t:
            del self._expected[t.handle.token]
        for c, att in list(t.attached.items()):
            st = self._conns.get(c)
            if st is not None:
                st.rules.forget(att.transfer_id, t)
        t.attached.clear()

    def _lingers(self, t: _Rx) -> None:
        """``t`` finished: on each of its connections it lingers, no longer open."""
        for c, att in t.attached.items():
            st = self._conns.get(c)
            if st is not None:
                st.rules.lingers(att.transfer_id, t)

    def _queue_write(self, t: _Rx, w: Write, peer: Peer | None) -> None:
        size = HEADER_SIZE + DATA_HEADER_SIZE + w.data.wire_length
        if peer is not None:
            self._peers.charge(peer, size)

        def done(error: BaseException | None) -> None:
            if error is not None:
                outs = t.write_failed(w.job, error, self._now())
            else:
                outs = t.written(w.job, self._now())
            if peer is not None:
                self._peers.refund(peer, size)
            data = w.data.data
            if isinstance(data, memoryview) and not w.data.placed:
                self._bufpool.put(data.obj)
            self._apply(t, outs)

        if self._writes.inline(w.data):  # now, on the loop: no task, no thread
            try:
                decode_and_write(t.sink, w.data, w.pieces)
            except Exception as e:
                done(e)
            else:
                done(None)
            return

        async def job() -> None:
            try:
                await self._writes.write(t.sink, w.data, w.pieces)
            except Exception as e:
                done(e)
            else:
                done(None)

        self._writes.push(t.priority, t.total - t.received_bytes, job)

    def _flush_now(self, t: _Rx) -> None:
        try:
            t.sink.flush()
        except Exception as e:
            self._flush_failed(t, e)
            return
        self._apply(t, t.flushed(self._now()))

    async def _flush(self, t: _Rx) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, t.sink.flush)
        except Exception as e:
            self._flush_failed(t, e)
            return
        self._apply(t, t.flushed(self._now()))

    def _flush_failed(self, t: _Rx, e: BaseException) -> None:
        err = e if isinstance(e, KVBridgeError) else KVBridgeError(f"sink flush failed: {e!r}")
        self._apply(t, t.flush_failed(err, self._now()))
