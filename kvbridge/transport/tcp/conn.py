"""One framed, handshaken TCP (or TLS) connection on asyncio.

:class:`FrameConnection` is an :class:`asyncio.BufferedProtocol` around the
sans-IO :class:`~kvbridge.wire.FrameDecoder`: the event loop reads straight
into the decoder's buffers (a DATA payload lands in its own allocation), every
decoded message goes to ``handler``.  The keepalive rules (PING when idle,
PONG, ERROR, close with :class:`PeerGone` when the peer is silent) are the
sans-IO :class:`~kvbridge.wire.connection.Keepalive`: this driver tells it
of every read and write, runs its timer and carries out what it returns.  It
owns write flow control (:meth:`drain`) and read backpressure
(:meth:`hold_reading`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl as _ssl
import time
from collections.abc import Callable

from ...errors import (
    AuthenticationError,
    ConnectTimeout,
    HandshakeTimeout,
    KVBridgeError,
    LocalProtocolError,
    PeerGone,
    RemoteProtocolError,
    code_for_error,
    map_os_error,
)
from ...wire.codec import FrameDecoder, encode_frame_parts
from ...wire.connection import Close, Keepalive, Send
from ...wire.frames import (
    CONTROL_FIRST,
    Auth,
    Capability,
    Control,
    Error,
    Hello,
    HelloAck,
    Message,
    Ready,
)
from ...wire.handshake import ClientHandshake, PeerInfo, ServerHandshake

log = logging.getLogger("kvbridge.transport")

__all__ = ["FrameConnection", "connect", "serve_handshake"]

Handler = Callable[["FrameConnection", Message], None]
_HANDSHAKE_MAX_PAYLOAD = 65536
_HANDSHAKE_STAGING = 8192  # a connection's read buffer until it authenticated
_STAGING = 256 << 10  # then


CLOSE_GRACE_S = 5.0  # at most this long to flush a closing connection's queue


class FrameConnection(asyncio.BufferedProtocol):
    """A framed connection.  Before the handshake completes, messages queue in
    an inbox; afterwards they go to ``handler`` (set by the owner)."""

    _ids = itertools.count(1)

    def __init__(
        self,
        *,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 20.0,
        on_made: Callable[[FrameConnection], None] | None = None,
        replies_only: bool = False,
    ) -> None:
        self.id = next(self._ids)
        self.frames_in = 0  # frames decoded so far
        self.decoder = FrameDecoder(_HANDSHAKE_MAX_PAYLOAD, staging=_HANDSHAKE_STAGING)
        self.decoder.on_message = self._on_decoded  # in order, as each frame is parsed
        self.transport: asyncio.Transport | None = None
        self.peer: PeerInfo | None = None
        self.handler: Handler | None = None
        self.on_close: list[Callable[[FrameConnection, KVBridgeError | None], None]] = []
        self.keepalive_interval = keepalive_interval
        self.keepalive_timeout = keepalive_timeout
        self.closed = False
        self.close_error: KVBridgeError | None = None
        self._inbox: asyncio.Queue[Message | KVBridgeError] = asyncio.Queue()
        self._on_made = on_made
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._holds = 0
        # a side whose writes only answer what it reads (the receiver) stops
        # reading while its write buffer is over the high-water mark: a peer
        # that never reads our replies cannot make us buffer them without
        # bound, and once it is silent to us, keepalive drops it
        self._replies_only = replies_only
        self._held_for_writes = False
        self.keepalive = Keepalive(keepalive_interval, keepalive_timeout, time.monotonic())
        self._corked = 0  # nesting depth of cork()
        self._out: list[bytes | memoryview] = []  # frames sent while corked
        self._keepalive: asyncio.Task[None] | None = None
        self.peername: object = None

    # ---- asyncio protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peername = transport.get_extra_info("peername")
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.keepalive.received(time.monotonic())
        self._corked += 1  # the replies to this read leave in one write
        try:
            self.decoder.buffer_updated(nbytes)
        except KVBridgeError as e:
            self.fail(e)
        finally:
            self._corked -= 1
            if not self._corked and self._out:
                self._write_held()

    def _on_decoded(self, m: Message) -> None:
        self.frames_in += 1
        if not self.closed:
            self._dispatch(m)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        err: KVBridgeError | None = self.close_error
        if err is None:
            err = map_os_error(exc, "transfer") if exc else PeerGone("peer closed the connection")
        self._finish(err)

    def pause_writing(self) -> None:
        self._can_write.clear()
        if self._replies_only and not self._held_for_writes:
            self._held_for_writes = True
            self.hold_reading()

    def resume_writing(self) -> None:
        self._can_write.set()
        if self._held_for_writes:
            self._held_for_writes = False
            self.release_reading()

    # ---- dispatch ------------------------------------------------------------------------
    def _dispatch(self, m: Message) -> None:
        outs = Keepalive.receive(m)  # PING, PONG, ERROR: at any time
        if outs is not None:
            for o in outs:
                if isinstance(o, Send):
                    self.send(o.message)
                else:  # the peer's ERROR: the connection ends with its error
                    self.close_error = o.error
                    if self.handler is None:
                        self._inbox.put_nowait(o.error)
                    self.abort_transport()
            return
        if self.handler is None:
            self._inbox.put_nowait(m)
        else:
            try:
                self.handler(self, m)
            except KVBridgeError as e:
                self.fail(e)

    async def next_message(self) -> Message:
        """The next message before a handler is set (handshake phase)."""
        item = await self._inbox.get()
        if isinstance(item, KVBridgeError):
            raise item
        return item

    # ---- output --------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        """Queue one frame for writing (never blocks; see :meth:`drain`)."""
        if self.closed or self.transport is None:
            raise PeerGone("connection is closed")
        parts = encode_frame_parts(msg)
        if self.peer is not None:
            n = sum(len(p) for p in parts) - 12
            if n > self.peer.max_frame:
                raise LocalProtocolError(
                    f"frame of {n} bytes exceeds the peer's limit {self.peer.max_frame}"
                )
        if self._corked:
            self._out += parts
        elif len(parts) == 1:
            self.transport.write(parts[0])
        else:
            self.transport.writelines(parts)
        self.keepalive.sent(time.monotonic())

    def cork(self) -> None:
        """Hold the frames sent from now on until the matching :meth:`uncork`
        (calls nest), then write them at once: one system call, and the peer
        reads them together."""
        self._corked += 1

    def uncork(self) -> None:
        self._corked -= 1
        if not self._corked and self._out:
            self._write_held()

    def _write_held(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        if self.transport is not None and not self.closed:
            self.transport.writelines(out)

    def send_control(self, type: int, payload: bytes, flags: int = 0) -> None:
        """Send a CONTROL frame (types 0x40-0xFF) with an opaque payload."""
        if not CONTROL_FIRST <= type <= 0xFF:
            raise LocalProtocolError(f"control type {type:#x} outside 0x40-0xFF")
        self.send(Control(type, flags, bytes(payload)))

    async def drain(self) -> None:
        """Wait until the write buffer is below its high-water mark."""
        while not self._can_write.is_set():
            if self.closed:
                raise self.close_error or PeerGone("connection closed")
            waiter = asyncio.ensure_future(self._can_write.wait())
            closer = asyncio.ensure_future(self._closed_event.wait())
            try:
                await asyncio.wait((waiter, closer), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                closer.cancel()
        if self.closed:
            raise self.close_error or PeerGone("connection closed")

    def set_write_limits(self, high: int) -> None:
        if self.transport is not None:
            self.transport.set_write_buffer_limits(high=high, low=high // 2)

    @property
    def write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() if self.transport else 0

    # ---- read backpressure ---------------------------------------------------------------
    def hold_reading(self) -> None:
        self._holds += 1
        if self._holds == 1 and self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def release_reading(self) -> None:
        self._holds -= 1
        if self._holds == 0 and self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def _closed_event(self) -> asyncio.Event:
        ev = getattr(self, "_cev", None)
        if ev is None:
            ev = asyncio.Event()
            if self.closed:
                ev.set()
            self._cev = ev
        return ev

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def start(self, peer: PeerInfo, handler: Handler) -> None:
        """The handshake is done: bound frames by our limit, start keepalive."""
        self.peer = peer
        self.decoder.version = peer.version
        self.decoder.set_staging(_STAGING)
        self.handler = handler
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, KVBridgeError):
                self.fail(item)
                return
            self._dispatch(item)
        self._keepalive = asyncio.get_running_loop().create_task(self._keepalive_loop())

    def set_max_payload(self, n: int) -> None:
        self.decoder.max_payload = n

    async def _keepalive_loop(self) -> None:
        """The keepalive timer: sleeps until the rules' next deadline (reads
        and writes move it), then carries out their verdict."""
        ka = self.keepalive
        while not self.closed:
            # a millisecond past it: a timer that fires early finds nothing due
            await asyncio.sleep(max(0.0, ka.next_deadline - time.monotonic()) + 0.001)
            for o in ka.poll(time.monotonic()):
                if isinstance(o, Close):
                    self.fail(o.error, send_error=o.send_error)
                    self.abort_transport()  # nothing to flush to a peer that is gone
                    return
                try:
                    self.send(o.message)
                except KVBridgeError:
                    ka.sent(time.monotonic())  # closing: no PING goes out, none is due

    def fail(self, exc: KVBridgeError, *, send_error: bool = True) -> None:
        """Close because of ``exc``; tell the peer with an ERROR frame if possible."""
        if self.closed:
            return
        if self.close_error is None:
            self.close_error = exc
        if send_error and isinstance(exc, RemoteProtocolError | KVBridgeError):
            with contextlib.suppress(Exception):
                self.send(Error(code_for_error(exc), str(exc)[:1000]))
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._write_held()  # held frames (an ERROR, say) go out before the close
            self.transport.close()  # graceful: flushes what is queued first
            if self.transport.get_write_buffer_size():
                # a peer that does not read would hold a graceful close open
                # for ever: give it a short grace, then drop the connection
                grace = min(self.keepalive_timeout, CLOSE_GRACE_S)
                asyncio.get_running_loop().call_later(grace, self.abort_transport)
        if self.transport is None:
            self._finish(self.close_error)

    def abort_transport(self) -> None:
        self._out = []
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def _finish(self, err: KVBridgeError | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._out = []
        self.close_error = self.close_error or err or PeerGone("connection closed")
        self._closed_event.set()
        self._can_write.set()
        if self._keepalive is not None:
            self._keepalive.cancel()
        self._inbox.put_nowait(self.close_error)
        for cb in list(self.on_close):
            try:
                cb(self, self.close_error)
            except Exception:
                log.exception("close callback failed")


async def connect(
    host: str,
    port: int,
    handshake: ClientHandshake,
    *,
    ssl: _ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    connect_timeout: float = 10.0,
    handshake_timeout: float = 10.0,
    keepalive_interval: float = 5.0,
    keepalive_timeout: float = 20.0,
) -> FrameConnection:
    """Open a connection and run the client handshake; raises ConnectTimeout,
    HandshakeTimeout, PeerGone, or the handshake's typed error.

    Over TLS, a receiver that resets the TLS handshake, or closes the
    connection after it without answering HELLO (no ERROR frame), refused us
    at the TLS layer: our client certificate (absent, from another CA,
    expired) or our TLS parameters.  A kvbridge receiver answers every HELLO
    otherwise, so that is AuthenticationError at once, not PeerGone to
    retry.  (asyncio reports such a refusal as a reset or a clean close, never
    with the alert, so the reason cannot be told apart further.)"""
    loop = asyncio.get_running_loop()
    try:
        _, conn = await asyncio.wait_for(
            loop.create_connection(
                lambda: FrameConnection(
                    keepalive_interval=keepalive_interval, keepalive_timeout=keepalive_timeout
                ),
                host,
                port,
                ssl=ssl,
                server_hostname=(server_hostname or host) if ssl is not None else None,
                ssl_handshake_timeout=handshake_timeout if ssl is not None else None,
            ),
            connect_timeout,
        )
    except TimeoutError:
        raise ConnectTimeout(f"connect to {host}:{port} took over {connect_timeout} s") from None
    except (ConnectionResetError, ConnectionAbortedError, EOFError) as e:
        if ssl is None:
            raise map_os_error(e, "connect") from e
        raise AuthenticationError(
            f"{host}:{port} reset the TLS handshake: it refused our client certificate "
            f"or TLS parameters ({e!r})"
        ) from e
    except (OSError, _ssl.SSLError) as e:
        raise map_os_error(e, "connect") from e
    assert isinstance(conn, FrameConnection)
    try:
        await asyncio.wait_for(_client_steps(conn, handshake), handshake_timeout)
    except KVBridgeError as e:  # first: our timeout errors are TimeoutErrors too
        if ssl is not None and isinstance(e, PeerGone) and conn.frames_in == 0:
            e = AuthenticationError(
                f"{host}:{port} closed the TLS connection without answering HELLO: it "
                f"refused our client certificate or TLS parameters ({e})"
            )
        if handshake.error is not None:
            with contextlib.suppress(KVBridgeError):
                conn.send(handshake.error)
        conn.close_error = e
        conn.close()
        raise e from None
    except TimeoutError:
        conn.abort_transport()
        raise HandshakeTimeout(
            f"handshake with {host}:{port} took over {handshake_timeout} s"
        ) from None
    except asyncio.CancelledError:  # a caller's own deadline: leave no socket behind
        conn.abort_transport()
        raise
    conn.set_max_payload(handshake.max_frame)
    return conn


async def _client_steps(conn: FrameConnection, hs: ClientHandshake) -> None:
    conn.send(hs.hello())
    ack = await conn.next_message()
    if not isinstance(ack, HelloAck):
        raise RemoteProtocolError(f"expected HELLO_ACK, got {type(ack).__name__}")
    conn.send(hs.on_hello_ack(ack))
    ready = await conn.next_message()
    if not isinstance(ready, Ready):
        raise RemoteProtocolError(f"expected READY, got {type(ready).__name__}")
    hs.on_ready(ready)


async def serve_handshake(conn: FrameConnection, hs: ServerHandshake, timeout: float) -> PeerInfo:
    """Run the server side of the handshake on a fresh connection."""
    try:
        await asyncio.wait_for(_server_steps(conn, hs), timeout)
    except KVBridgeError as e:  # first: our timeout errors are TimeoutErrors too
        err = hs.error or Error(code_for_error(e), str(e))
        if not conn.closed:
            with contextlib.suppress(KVBridgeError):
                conn.send(err)
            conn.close_error = e
            conn.close()
        raise
    except TimeoutError:
        conn.abort_transport()
        raise HandshakeTimeout(f"handshake took over {timeout} s") from None
    assert hs.peer is not None
    return hs.peer


async def _server_steps(conn: FrameConnection, hs: ServerHandshake) -> None:
    hello = await conn.next_message()
    if not isinstance(hello, Hello):
        raise RemoteProtocolError(f"expected HELLO, got {type(hello).__name__}")
    conn.send(hs.on_hello(hello))
    auth = await conn.next_message()
    if not isinstance(auth, Auth):
        raise RemoteProtocolError(f"expected AUTH, got {type(auth).__name__}")
    ready = hs.on_auth(auth)
    conn.set_max_payload(hs.max_frame)
    assert hs.peer is not None
    # both announced RANGES: the client's DATA frames carry the header check
    # from its first frame after READY on (docs/protocol.md 5.9)
    conn.decoder.data_check = bool(hs.peer.capabilities & hs.capabilities & Capability.RANGES)
    conn.send(ready)
