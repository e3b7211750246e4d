"""The synchronous, thread-safe front end: what an engine's connector calls
from its own threads, polled once per scheduler step.

:class:`SyncBridge` runs kvbridge's event loop in a thread of its own (it
starts it in :meth:`~SyncBridge.start` and ends it in :meth:`~SyncBridge.close`)
and drives a :class:`~kvbridge.bridge.PrefillBridge` (sending, with leases)
and, when it listens or has UCX, a :class:`~kvbridge.bridge.DecodeBridge`
(receiving) on it: one object may both send and receive (vLLM's
``kv_both``).  Every method may be called from several threads at once; none
blocks longer than its bound (``call_timeout``, or a connect's
``connect_timeout``); none needs an event loop in the caller's thread.
Outcomes are collected as they happen and handed out by :meth:`~SyncBridge.poll`,
which never blocks.  docs/engine-integration.md shows the calls in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import ssl as _ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from .._waits import wait_within
from ..errors import (
    BridgeClosed,
    CallTimeout,
    ConnectTimeout,
    InvalidArgument,
    KVBridgeError,
    PeerGone,
    Unavailable,
)
from ..pack import PagedKVCache
from ..transport.tcp.receiver import ReceiverLimits
from ..wire.frames import CONTROL_FIRST
from .decode import DecodeBridge, Expectation, PreparedExpect
from .destination import TcpDestination
from .events import BridgeEvents, TransferDone, TransferFailed
from .handles import Delivery, DeliveryStats, Outcome, SendGroup
from .identity import check_model_id
from .leases import DEFAULT_LEASE, check_lease_seconds
from .loop import LoopThread
from .metrics import BridgeMetrics
from .options import BridgeOptions
from .prefill import LayerwiseSend, PeerConfig, PrefillBridge
from .ticket import Ticket

if TYPE_CHECKING:
    from ..registry.view import Resolver

__all__ = ["BridgeEvents", "SyncBridge", "TransferDone", "TransferFailed"]

log = logging.getLogger("kvbridge.bridge")
ControlFn = Callable[[str, int, bytes], None]
_CONNECT_SLACK = 0.5  # beyond connect_timeout, for the loop thread to answer


class _Send:
    """A send from the moment ``send()`` accepted it: its destinations are
    known at once; ``group`` once the loop started it.  What the engine asks
    of it before then (layers ready, a renewal, a cancel) waits here and is
    applied when it starts."""

    def __init__(self, rid: str, names: list[str], layerwise: bool) -> None:
        self.rid = rid
        self.names = names
        self.layerwise = layerwise
        self.group: SendGroup | None = None
        self.reported: set[str] = set()
        self.released = False
        self.layers = 0  # layers_ready(n) asked before the group existed
        self.renewals: list[tuple[float | None, float]] = []  # (seconds, asked at)
        self.cancel_reason: str | None = None


class _Recv:
    """An expect from the moment ``expect()`` returned its ticket; ``exp``
    once the loop registered it."""

    def __init__(self, rid: str, peer: str) -> None:
        self.rid = rid
        self.peer = peer
        self.exp: Expectation | None = None
        self.reported = False
        self.cancel_reason: str | None = None


_NEW, _RUNNING, _CLOSING, _CLOSED = "new", "running", "closing", "closed"


class SyncBridge:
    """One engine's bridge, called from plain threads.

    ``cache`` is the engine's paged KV cache; ``identity`` its name at every
    handshake; ``model_id`` the model it serves (a name or a digest of the
    weights: peers serving another model are refused).  ``tcp_listen=(host,
    port)`` also makes it a TCP receiver (``psk``, ``ssl``,
    ``allowed_identities``, ``tls_identity``, ``limits``,
    ``keepalive_interval``, ``keepalive_timeout`` as for
    :class:`DecodeBridge`); ``ucx=True`` registers the cache for UCX
    (sending and receiving share the one agent; ``ucx_control=(host, port)``
    serves its metadata there), or ``ucx_agent`` sends with a started agent
    of the caller's.  Every option is one of
    :class:`~kvbridge.bridge.options.BridgeOptions`, with the same default
    as in the async bridges.  ``lease_timeout`` is the default lease of a send's
    pages, ``call_timeout`` the bound on every blocking call, ``metrics`` a
    :class:`~kvbridge.bridge.metrics.BridgeMetrics` (None: a private one,
    as ``.metrics``).  ``clock`` is the lease clock (tests pass a fake one
    and call :meth:`expire_leases`).  ``resolver`` and ``peer_defaults``:
    tickets may name destinations by engine id alone, found through a
    registry view and connected on demand by :meth:`send`
    (:meth:`kvbridge.bridge.PrefillBridge.reach`).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        *,
        identity: str = "kvbridge",
        model_id: str = "",
        tcp_listen: tuple[str, int] | None = None,
        psk: bytes | dict[str, bytes] | None = None,
        ssl: _ssl.SSLContext | None = None,
        allowed_identities: frozenset[str] | None = None,
        ucx: bool = False,
        ucx_options: dict[str, Any] | None = None,
        lease_timeout: float = DEFAULT_LEASE,
        call_timeout: float = 10.0,
        metrics: BridgeMetrics | None = None,
        limits: ReceiverLimits | None = None,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 20.0,
        clock: Callable[[], float] = time.monotonic,
        tls_identity: str = "cn_or_san",
        ucx_agent: Any = None,
        ucx_control: tuple[str, int] | None = None,
        resolver: Resolver | None = None,
        peer_defaults: PeerConfig | None = None,
    ) -> None:
        if not hasattr(cache, "layout"):
            raise InvalidArgument(f"cache must be a kvbridge.pack.PagedKVCache, not {cache!r}")
        _seconds(call_timeout, "call_timeout")
        check_lease_seconds(lease_timeout, "lease_timeout")
        self.cache = cache
        self.identity = identity
        self.model_id = check_model_id(model_id)
        self.call_timeout = float(call_timeout)
        self.lease_timeout = float(lease_timeout)
        self.metrics = metrics if metrics is not None else BridgeMetrics()
        if ucx and ucx_agent is not None:
            raise InvalidArgument(
                "ucx=True makes the bridge's own UCX agent; pass ucx=True or ucx_agent, not both"
            )
        self._ucx = bool(ucx)
        self._ucx_options = dict(ucx_options or {})
        # the one set of options both async bridges are built from
        self._options = BridgeOptions(
            identity=identity,
            model_id=self.model_id,
            tcp_listen=tcp_listen,
            psk=psk,
            ssl=ssl,
            allowed_identities=allowed_identities,
            tls_identity=tls_identity,
            limits=limits,
            ucx=self._ucx,
            ucx_options=self._ucx_options,
            ucx_agent=ucx_agent,
            ucx_control=ucx_control,
            keepalive_interval=keepalive_interval,
            keepalive_timeout=keepalive_timeout,
            lease_timeout=self.lease_timeout,
            clock=clock,
            resolver=resolver,
            peer_defaults=peer_defaults,
        )
        self._clock = clock
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._state = _NEW
        self._events = BridgeEvents()
        self._sends: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._control: dict[int, ControlFn] = {}
        self._connecting: set[str] = set()
        self._loop: LoopThread | None = None
        self._prefill: PrefillBridge | None = None
        self._decode: DecodeBridge | None = None
        self._tcp_port: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> SyncBridge:
        """Start kvbridge's loop thread, the listener and the UCX agent;
        returns the bridge.  A second call returns at once."""
        if not self._start_lock.acquire(timeout=2 * self.call_timeout):
            raise CallTimeout("start() is still running in another thread")
        try:
            with self._lock:
                if self._state in (_CLOSING, _CLOSED):
                    raise BridgeClosed("the bridge is closed; make a new one")
                if self._state == _RUNNING:
                    return self
            lt = LoopThread(f"kvbridge-{self.identity}")
            try:
                lt.call(functools.partial(self._astart, lt), self.call_timeout, "start()")
            except BaseException:
                try:
                    lt.call(self._aclose_parts, self.call_timeout, "start() cleanup")
                except KVBridgeError:
                    pass
                lt.stop(self.call_timeout)
                raise
            with self._lock:
                self._loop = lt
                self._state = _RUNNING
            return self
        finally:
            self._start_lock.release()

    async def _astart(self, lt: LoopThread) -> None:
        view = self.metrics.for_bridge(self.identity, self.model_id)
        opts = self._options
        if opts.tcp_listen is not None or self._ucx:
            self._decode = DecodeBridge(self.cache, **opts.kwargs_for(DecodeBridge, metrics=view))
            try:
                await self._decode.start()
            except OSError as e:  # the address is taken, or not ours
                raise Unavailable(f"cannot listen on {opts.tcp_listen}: {e}") from e
            if opts.tcp_listen is not None:
                self._tcp_port = int(self._decode.tcp_address[1])
                # an OPEN may name a ticket whose expect() is still queued
                self._decode.tcp.token_miss = lt.drain
        agent = self._decode.ucx_agent if self._ucx and self._decode else opts.ucx_agent
        self._prefill = PrefillBridge(
            self.cache, **opts.kwargs_for(PrefillBridge, ucx_agent=agent, metrics=view)
        )
        for ft in list(self._control):
            self._install_control(ft)

    async def _aclose_parts(self) -> None:
        if self._prefill is not None:
            await self._prefill.close()
        if self._decode is not None:
            await self._decode.close()

    def close(self) -> BridgeEvents:
        """End every pending transfer (at both ends, each reported with
        :class:`~kvbridge.errors.BridgeClosed`), close the connections, the
        listener and the UCX agent, and stop the loop thread, within
        ``call_timeout``.  Returns the events not yet polled, those endings
        included.  After it, every call raises ``BridgeClosed`` at once (a
        second ``close()`` returns empty events)."""
        with self._lock:
            if self._state in (_CLOSING, _CLOSED):
                return BridgeEvents()
            if self._state == _NEW:
                self._state = _CLOSED
                return BridgeEvents()
            self._state = _CLOSING
            lt = self._loop
        assert lt is not None
        deadline = time.monotonic() + self.call_timeout
        try:
            lt.call(functools.partial(self._aclose, lt), self.call_timeout, "close()")
        except KVBridgeError as e:
            log.warning("bridge %r did not close cleanly: %s", self.identity, e)
            self._end_pending()  # whatever the loop could not report
        finally:
            lt.stop(deadline - time.monotonic())
            with self._lock:
                self._state = _CLOSED
                ev, self._events = self._events, BridgeEvents()
        return ev

    def _end_pending(self) -> tuple[list[_Send], list[_Recv]]:
        """Report every pending transfer as ended by close (once each)."""
        err = BridgeClosed(f"bridge {self.identity!r} closed with the transfer pending")
        with self._lock:
            sends, recvs = list(self._sends.values()), list(self._recvs.values())
            self._sends.clear()
            self._recvs.clear()
            for s in sends:
                self._report_send_end(s, err)
            for r in recvs:
                self._report_recv(r, err)
        return sends, recvs

    def _report_send_end(self, s: _Send, err: KVBridgeError) -> None:
        """(lock held) Every destination not reported yet failed with
        ``err``, and the send released."""
        for name in s.names:
            if name not in s.reported:
                s.reported.add(name)
                self._events.failed.append(TransferFailed(s.rid, name, "send", err))
        if not s.released:
            s.released = True
            self._events.released.append(s.rid)

    def _report_recv(self, r: _Recv, out: Outcome) -> None:
        """(lock held) The receive's one outcome, unless it had one."""
        if r.reported:
            return
        r.reported = True
        if isinstance(out, DeliveryStats):
            self._events.received.append(TransferDone(r.rid, r.peer, out))
        else:
            self._events.failed.append(TransferFailed(r.rid, r.peer, "recv", out))

    async def _aclose(self, lt: LoopThread) -> None:
        # the calls queued before close() first: their transfers start and are
        # then ended below like every other, so their peers hear of it too
        lt.drain()
        sends, recvs = self._end_pending()
        err = BridgeClosed(f"bridge {self.identity!r} closed")
        for s in sends:
            if s.group is not None:
                s.group.fail(err)
        for r in recvs:
            if r.exp is not None:
                r.exp.cancel(str(err))
        await self._aclose_parts()

    def __enter__(self) -> SyncBridge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state ----------------------------------------------------------------------
    def _check_running(self, what: str) -> None:
        """(lock held) Raise unless the bridge runs."""
        if self._state != _RUNNING:
            if self._state == _NEW:
                raise InvalidArgument(f"{what}: call start() first")
            raise BridgeClosed(f"{what}: the bridge is closed")

    def _running(self, what: str) -> LoopThread:
        with self._lock:
            if self._state == _RUNNING and self._loop is not None:
                return self._loop
            if self._state == _NEW:
                raise InvalidArgument(f"{what}: call start() first")
        raise BridgeClosed(f"{what}: the bridge is closed")

    def _on_loop_check(self, what: str) -> None:
        """On the loop: a call that raced close() must not act."""
        if self._state != _RUNNING:
            raise BridgeClosed(f"{what}: the bridge is closed")

    def _live(self) -> bool:
        """On the loop: queued work still runs (close() drains the queue
        while closing, then ends what it started)."""
        return self._state in (_RUNNING, _CLOSING)

    @property
    def running(self) -> bool:
        return self._state == _RUNNING

    # ---- addresses ------------------------------------------------------------------
    @property
    def tcp_port(self) -> int:
        """The port the TCP listener is bound to (``tcp_listen``)."""
        self._running("tcp_port")
        if self._tcp_port is None:
            raise Unavailable("this bridge has no TCP listener (tcp_listen=None)")
        return self._tcp_port

    def ucx_metadata(self) -> bytes:
        """The opaque bytes a peer passes to ``connect`` (``PeerConfig("ucx",
        metadata=...)``): this bridge's description around its UCX agent's
        registration blob."""
        lt = self._running("ucx_metadata()")

        def run() -> bytes:
            self._on_loop_check("ucx_metadata()")
            if self._decode is None or not self._ucx:
                raise Unavailable("this bridge was started with ucx=False")
            return self._decode.ucx_metadata()

        return lt.call_fn(run, self.call_timeout, "ucx_metadata()")

    # ---- peers ----------------------------------------------------------------------
    def connect(self, name: str, peer: PeerConfig) -> None:
        """Connect a destination by name (TCP across the WAN, UCX inside the
        datacenter).  Bounded by ``peer.connect_timeout``; raises the
        handshake's typed error (``IncompatiblePeer`` says what differs)."""
        lt = self._running("connect()")
        if not isinstance(peer, PeerConfig):
            raise InvalidArgument(f"peer must be a PeerConfig, not {peer!r}")
        timeout = float(peer.connect_timeout)

        async def run() -> None:
            self._on_loop_check("connect()")
            assert self._prefill is not None
            if name in self._connecting or name in self._prefill.destinations:
                raise InvalidArgument(f"destination {name!r} is already connected")
            self._connecting.add(name)
            try:
                await wait_within(
                    self._prefill.connect(name, peer),
                    timeout,
                    lambda: ConnectTimeout(f"{name}: not connected within {timeout:g} s"),
                )
            finally:
                self._connecting.discard(name)
            if self._state != _RUNNING:
                raise BridgeClosed("connect(): the bridge closed meanwhile")
            for ft in list(self._control):
                self._install_control(ft, only=name)

        lt.call(run, timeout + _CONNECT_SLACK, f"connect({name!r})")

    def reach(self, name: str) -> None:
        """Make sure destination ``name`` is connected to the incarnation the
        resolver names now (``resolver=``; a static destination is only
        checked): connects it, or reconnects it after its engine restarted
        (a new generation or address), so that CONTROL messages (a decode's
        tickets) can flow before the first send.  Bounded by
        ``peer_defaults.connect_timeout``; raises what
        :meth:`kvbridge.bridge.PrefillBridge.reach` raises (``UnknownPeer``,
        ``IncompatiblePeer``, the handshake's errors)."""
        lt = self._running("reach()")
        rp = self._prefill.resolved if self._prefill is not None else None
        ct = float(rp.defaults.connect_timeout) if rp is not None else 10.0

        def late(n: str) -> ConnectTimeout:
            return ConnectTimeout(f"{n}: not connected within {ct:g} s")

        async def run() -> None:
            self._on_loop_check("reach()")
            await self._reach(name, ct, late)

        lt.call(run, ct + _CONNECT_SLACK, f"reach({name!r})")

    async def _reach(self, name: str, ct: float, late: Callable[[str], KVBridgeError]) -> None:
        assert self._prefill is not None
        before = self._prefill.destinations
        d = self._prefill.destination(name) if name in before else None
        await wait_within(self._prefill.reach(name), ct, functools.partial(late, name))
        if self._prefill.destination(name) is not d:
            for ft in list(self._control):  # a new connection: its CONTROL handlers
                self._install_control(ft, only=name)

    @property
    def destinations(self) -> list[str]:
        lt = self._running("destinations")
        return lt.call_fn(
            lambda: list(self._prefill.destinations) if self._prefill else [],
            self.call_timeout,
            "destinations",
        )

    # ---- receiving ------------------------------------------------------------------
    @overload
    def expect(
        self,
        request_id: str | int,
        block_table: Any,
        start: int | None = ...,
        end: int | None = ...,
        *,
        layers: tuple[int, int] | None = ...,
        via: str = ...,
        timeout: float = ...,
        peer: str = ...,
        heads: tuple[int, int] | None = ...,
        sources: None = ...,
    ) -> bytes: ...

    @overload
    def expect(
        self,
        request_id: str | int,
        block_table: Any,
        start: int | None = ...,
        end: int | None = ...,
        *,
        layers: tuple[int, int] | None = ...,
        via: str = ...,
        timeout: float = ...,
        peer: str = ...,
        heads: tuple[int, int] | None = ...,
        sources: Sequence[tuple[str, tuple[int, int]]],
    ) -> dict[str, bytes]: ...

    def expect(
        self,
        request_id: str | int,
        block_table: Any,
        start: int | None = None,
        end: int | None = None,
        *,
        layers: tuple[int, int] | None = None,
        via: str = "tcp",
        timeout: float = 60.0,
        peer: str = "",
        heads: tuple[int, int] | None = None,
        sources: Sequence[tuple[str, tuple[int, int]]] | None = None,
    ) -> bytes | dict[str, bytes]:
        """Expect tokens ``[start, end)`` of a request into our pages
        ``block_table``; returns the ticket (opaque bytes) for the sender.
        The outcome arrives through :meth:`poll` (``received`` or ``failed``,
        ``peer`` as given here).  The block table is copied.  A
        :class:`~kvbridge.span.KVSpan` may stand for ``block_table``,
        ``start``, ``end``, ``layers`` and ``heads``: ``expect(rid, span)``.

        With tensor parallelism, ``heads`` is the range of the model's KV
        heads wanted (default all the cache holds) and ``sources`` the
        sender ranks and the heads each holds, ``[(name, (h0, h1)), ...]``
        (:func:`kvbridge.bridge.tp_sources`): then the call returns a dict of
        one ticket per sender that holds some of the wanted heads, and
        :meth:`poll` reports the request once, when all of them landed or
        when the first part failed (which cancels the others)."""
        lt = self._running("expect()")
        _seconds(timeout, "timeout")
        dec = self._decode
        if dec is None:
            raise Unavailable(
                "this bridge does not receive: start it with tcp_listen=(host, port) or ucx=True"
            )
        prep = dec.prepare_expect(
            request_id, block_table, start, end,
            layers=layers, via=via, heads=heads, sources=sources,
        )  # fmt: skip
        rid = prep.request_id
        st = _Recv(rid, peer)
        with self._lock:
            self._check_running("expect()")
            if rid in self._recvs:
                raise InvalidArgument(f"request {rid!r} is already expected")
            self._recvs[rid] = st
        lt.submit(functools.partial(self._start_recv, st, prep, timeout))
        return prep.ticket if sources is None else prep.tickets

    def _start_recv(self, st: _Recv, prep: PreparedExpect, timeout: float) -> None:
        """On the loop: register a prepared expect (queued by expect())."""
        if not self._live() or st.reported:
            return  # close() reported it
        assert self._decode is not None
        try:
            exp = self._decode.expect_prepared(prep, timeout)
        except Exception as e:
            self._recv_failed(st, _typed(e, f"expect({st.rid!r}) failed to start"))
            return
        st.exp = exp
        exp.add_done_callback(lambda d: self._on_received(st, d))
        if st.cancel_reason is not None:
            exp.cancel(st.cancel_reason)

    def _recv_failed(self, st: _Recv, err: KVBridgeError) -> None:
        with self._lock:
            if self._recvs.get(st.rid) is st:
                del self._recvs[st.rid]
            self._report_recv(st, err)

    def _on_received(self, st: _Recv, d: Delivery) -> None:
        out = d.outcome()
        if out is None:
            return
        with self._lock:
            if self._recvs.get(st.rid) is st:
                del self._recvs[st.rid]
            self._report_recv(st, out)

    # ---- sending --------------------------------------------------------------------
    def send(
        self,
        request_id: str | int,
        block_table: Any,
        tickets: Mapping[str, bytes | Ticket],
        *,
        priority: int = 0,
        timeout: float = 60.0,
        lease: float | None = None,
        layerwise: bool = False,
        layer_timeout: float = 30.0,
    ) -> None:
        """Send a request's KV to every destination whose ticket is given;
        returns at once, without waiting for kvbridge's loop thread.  Every
        ticket is checked first (a bad one raises here and nothing moves).
        What only the loop can find (a destination that went away meanwhile,
        one a resolver cannot reach) arrives through :meth:`poll` as a
        ``failed`` outcome per destination, with ``released``.  The pages
        stay leased to kvbridge until :meth:`poll` lists the request in
        ``released`` (at most ``lease`` seconds, default ``lease_timeout``,
        unless renewed).  ``layerwise``: the layers leave as
        :meth:`layers_ready` releases them.  ``block_table`` is our pages of
        the request (copied), or a :class:`~kvbridge.span.KVSpan` of them
        that also bounds what the tickets may ask for."""
        lt = self._running("send()")
        rid = str(request_id)
        _seconds(timeout, "timeout")
        _seconds(layer_timeout, "layer_timeout")
        if lease is not None:
            check_lease_seconds(lease)
        tk = {str(n): _ticket_bytes(n, t) for n, t in dict(tickets).items()}
        if not tk:
            raise InvalidArgument("send() needs at least one destination's ticket")
        pre = self._prefill
        assert pre is not None
        rp = pre.resolved
        # (the table copied once, the tickets decoded once: the loop gets both)
        bt, decoded = pre.check_send(rid, block_table, tk, reach_later=rp is not None)
        tk = dict[str, bytes | Ticket](decoded)
        st = _Send(rid, list(tk), bool(layerwise))
        with self._lock:
            self._check_running("send()")
            if rid in self._sends:
                raise InvalidArgument(f"request {rid!r} is being sent already")
            self._sends[rid] = st
        # the lease counts from this call, whenever the loop starts the send
        kw = {"priority": priority, "timeout": timeout, "lease": lease, "granted_at": self._clock()}
        if layerwise:
            kw["layer_timeout"] = layer_timeout
        if rp is None:
            lt.submit(functools.partial(self._start_send, st, bt, tk, kw))
        else:  # destinations named by engine id: connected (or reconnected) first
            lt.submit(functools.partial(self._reach_then_send, st, bt, tk, kw))

    def _reach_then_send(
        self, st: _Send, bt: Any, tk: dict[str, bytes | Ticket], kw: dict[str, Any]
    ) -> None:
        assert self._prefill is not None and self._prefill.resolved is not None
        ct = float(self._prefill.resolved.defaults.connect_timeout)

        def late(name: str) -> ConnectTimeout:
            return ConnectTimeout(f"{name}: not connected within {ct:g} s")

        async def run() -> None:
            try:
                for name in tk:
                    if not self._live() or st.released:
                        return
                    await self._reach(name, ct, late)
            except Exception as e:
                self._send_failed(st, _typed(e, f"send({st.rid!r}): reaching a destination"))
                return
            self._start_send(st, bt, tk, kw)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_send(
        self, st: _Send, bt: Any, tk: dict[str, bytes | Ticket], kw: dict[str, Any]
    ) -> None:
        """On the loop: start a send that send() accepted."""
        if not self._live() or st.released:
            return  # close() reported it
        pre = self._prefill
        assert pre is not None
        try:
            group: SendGroup
            if st.layerwise:
                group = pre.send_layerwise(st.rid, bt, tk, **kw)
            else:
                group = pre.send(st.rid, bt, tk, **kw)
        except Exception as e:
            self._send_failed(st, _typed(e, f"send({st.rid!r}) failed to start"))
            return
        st.group = group
        group.on_outcome(lambda name, out: self._on_sent(st, name, out))
        group.on_done(lambda _g: self._on_released(st))
        # what the engine asked before the send started
        if st.layers and isinstance(group, LayerwiseSend):
            group.layers_ready(st.layers)
        for seconds, at in st.renewals:
            pre.renew_lease(st.rid, seconds, at=at)
        if st.cancel_reason is not None:
            group.cancel(st.cancel_reason)

    def _send_failed(self, st: _Send, err: KVBridgeError) -> None:
        with self._lock:
            if self._sends.get(st.rid) is st:
                del self._sends[st.rid]
            self._report_send_end(st, err)

    def _on_sent(self, st: _Send, name: str, out: Outcome) -> None:
        with self._lock:
            if name in st.reported:
                return
            st.reported.add(name)
            if isinstance(out, DeliveryStats):
                self._events.sent.append(TransferDone(st.rid, name, out))
            else:
                self._events.failed.append(TransferFailed(st.rid, name, "send", out))

    def _on_released(self, st: _Send) -> None:
        with self._lock:
            if self._sends.get(st.rid) is st:
                del self._sends[st.rid]
            if not st.released:
                st.released = True
                self._events.released.append(st.rid)

    def layers_ready(self, request_id: str | int, n: int) -> bool:
        """Layers ``[0, n)`` of a layer-wise send are computed: let them
        leave.  Returns at once; False when the request has no running send
        (it ended)."""
        lt = self._running("layers_ready()")
        rid = str(request_id)
        if isinstance(n, bool) or not isinstance(n, int | np.integer):
            raise InvalidArgument(f"layers_ready() takes a layer count, got {n!r}")
        k = int(n)
        layers = self.cache.layout.num_layers
        if not 0 <= k <= layers:
            raise InvalidArgument(f"layer {k} outside [0, {layers}]")
        with self._lock:
            st = self._sends.get(rid)
        if st is None:
            return False
        if not st.layerwise:
            raise InvalidArgument(f"request {rid!r} was not sent with layerwise=True")
        lt.submit(functools.partial(self._apply_layers, st, k))
        return True

    @staticmethod
    def _apply_layers(st: _Send, n: int) -> None:
        if st.group is None:
            st.layers = max(st.layers, n)
        elif isinstance(st.group, LayerwiseSend):
            st.group.layers_ready(n)

    def renew_lease(self, request_id: str | int, seconds: float | None = None) -> bool:
        """Extend a running send's lease to ``seconds`` from now (None: the
        length it was granted with).  Returns at once; False when the request
        holds no lease."""
        lt = self._running("renew_lease()")
        rid = str(request_id)
        if seconds is not None:
            check_lease_seconds(seconds)
        with self._lock:
            st = self._sends.get(rid)
        if st is None:
            return False
        # from this call, whenever the loop applies it
        lt.submit(functools.partial(self._apply_renewal, st, seconds, self._clock()))
        return True

    def _apply_renewal(self, st: _Send, seconds: float | None, at: float) -> None:
        if st.group is None:
            st.renewals.append((seconds, at))
        elif self._prefill is not None:
            self._prefill.renew_lease(st.rid, seconds, at=at)

    def expire_leases(self) -> list[str]:
        """Abort the sends whose lease has run out now (by the lease clock);
        the bridge does this by itself on a timer.  Returns their ids."""
        lt = self._running("expire_leases()")

        def run() -> list[str]:
            self._on_loop_check("expire_leases()")
            assert self._prefill is not None
            return self._prefill.expire_leases()

        return lt.call_fn(run, self.call_timeout, "expire_leases()")

    def cancel(self, request_id: str | int, reason: str = "cancelled by the engine") -> bool:
        """Abort a request's send and its expected receive at both ends;
        returns at once.  The endings arrive through :meth:`poll`
        (``Cancelled`` here, a typed error at the peer).  False when nothing
        of it was running."""
        lt = self._running("cancel()")
        rid = str(request_id)
        why = str(reason)
        with self._lock:
            s, r = self._sends.get(rid), self._recvs.get(rid)
        if s is None and r is None:
            return False
        lt.submit(functools.partial(self._apply_cancel, s, r, why))
        return True

    @staticmethod
    def _apply_cancel(s: _Send | None, r: _Recv | None, reason: str) -> None:
        if s is not None:
            if s.group is None:
                s.cancel_reason = s.cancel_reason or reason
            else:
                s.group.cancel(reason)
        if r is not None:
            if r.exp is None:
                r.cancel_reason = r.cancel_reason or reason
            else:
                r.exp.cancel(reason)

    # ---- outcomes -------------------------------------------------------------------
    def poll(self) -> BridgeEvents:
        """Everything that finished since the last call; never blocks."""
        with self._lock:
            if self._state == _CLOSED:
                raise BridgeClosed("poll(): the bridge is closed (close() returned the rest)")
            ev, self._events = self._events, BridgeEvents()
        return ev

    @property
    def pending(self) -> tuple[list[str], list[str]]:
        """Request ids of the sends and the receives still running."""
        with self._lock:
            return list(self._sends), list(self._recvs)

    # ---- control messages ---------------------------------------------------------------
    def send_control(self, peer: str, frame_type: int, payload: bytes) -> None:
        """A CONTROL frame (type 0x40-0xFF, docs/protocol.md 8) to a TCP
        destination by name, or to a sender connected to us by its identity."""
        lt = self._running("send_control()")
        ft = _control_type(frame_type)
        data = bytes(payload)

        def run() -> None:
            self._on_loop_check("send_control()")
            assert self._prefill is not None
            dest = self._prefill.destinations
            if peer in dest and isinstance(self._prefill.destination(peer), TcpDestination):
                self._prefill.tcp_sender(peer).send_control(ft, data)
                return
            rx = self._decode.tcp_receiver if self._decode is not None else None
            if rx is not None and peer in rx.peer_identities():
                rx.send_control(peer, ft, data)
                return
            raise PeerGone(f"no TCP connection to or from {peer!r}")

        lt.call_fn(run, self.call_timeout, "send_control()")

    def on_control(self, frame_type: int, fn: ControlFn) -> None:
        """Call ``fn(peer, frame_type, payload)`` on kvbridge's loop thread for
        each CONTROL frame of that type, from a destination (its name) or from
        a sender connected to us (its identity).  ``fn`` must not block; an
        exception in it is logged and the connection stays up."""
        ft = _control_type(frame_type)
        if not callable(fn):
            raise InvalidArgument("on_control needs a callable fn(peer, frame_type, payload)")
        with self._lock:
            if self._state in (_CLOSING, _CLOSED):
                raise BridgeClosed("on_control(): the bridge is closed")
            self._control[ft] = fn
            lt = self._loop if self._state == _RUNNING else None
        if lt is not None:
            lt.call_fn(lambda: self._install_control(ft), self.call_timeout, "on_control()")

    def _install_control(self, ft: int, only: str | None = None) -> None:
        def dispatch(peer: str, t: int, payload: bytes) -> None:
            fn = self._control.get(t)
            if fn is None:
                return
            try:
                fn(peer, t, bytes(payload))
            except Exception:
                log.exception("the CONTROL %#x handler of bridge %r raised", t, self.identity)

        rx = self._decode.tcp_receiver if self._decode is not None else None
        if rx is not None and only is None:
            rx.on_control(
                ft, lambda conn, t, p: dispatch(conn.peer.identity if conn.peer else "", t, p)
            )
        if self._prefill is not None:
            for name in self._prefill.destinations:
                d = self._prefill.destination(name)
                if isinstance(d, TcpDestination) and (only is None or name == only):
                    d.sender.on_control(ft, _from_destination(name, dispatch))


def _from_destination(
    name: str, dispatch: Callable[[str, int, bytes], None]
) -> Callable[[Any, int, bytes], None]:
    def handler(_conn: Any, t: int, payload: bytes) -> None:
        dispatch(name, t, payload)

    return handler


def _seconds(value: float, what: str) -> float:
    """A bound in seconds: finite and > 0 (a wait without one would not end)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgument(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _ticket_bytes(name: object, t: object) -> bytes | Ticket:
    if isinstance(t, Ticket):
        return t
    if not isinstance(t, bytes | bytearray | memoryview):
        raise InvalidArgument(f"{name}: a ticket is the bytes expect() returned, not {t!r}")
    return bytes(t)


def _control_type(frame_type: int) -> int:
    if isinstance(frame_type, bool) or not isinstance(frame_type, int | np.integer):
        raise InvalidArgument(f"frame_type must be an int in 0x40-0xFF, got {frame_type!r}")
    ft = int(frame_type)
    if not CONTROL_FIRST <= ft <= 0xFF:
        raise InvalidArgument(f"CONTROL frame type {ft:#x} outside 0x40-0xFF")
    return ft


def _typed(e: BaseException, what: str) -> KVBridgeError:
    """A failure found on the loop, as the typed error poll() reports."""
    if isinstance(e, KVBridgeError):
        return e
    log.error("%s: %s: %s", what, type(e).__name__, e, exc_info=e)
    return KVBridgeError(f"{what}: {type(e).__name__}: {e}")
