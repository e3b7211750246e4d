"""One destination of a prefill bridge, whatever its transport.

:class:`Destination` is the seam between the bridges and the transports: a
:class:`~kvbridge.bridge.prefill.PrefillBridge` holds one per connected name
and sends only through it.  :class:`TcpDestination` wraps a
:class:`~kvbridge.transport.tcp.TcpSender`; :class:`UcxDestination` a
:class:`~kvbridge.transport.ucx.UcxPeer` (public verbs only: ``send``,
``abort``, ``close``, ``error``, ``agent_id``), reconnected by its metadata
endpoint when it was given one.

The verbs: :meth:`Destination.check_ticket` (before anything is sent),
:meth:`Destination.send` (one whole send, or one layer range of it: a
:class:`~kvbridge.bridge.handles.Delivery`), :meth:`Destination.layerwise`
(a :class:`LayerFeed`: the readiness hook of a layer-wise send),
:meth:`Destination.abort` (tell the receiver a send that did not start
will not come), :meth:`Destination.close`, and ``stats`` (what it moved)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..errors import Cancelled, IncompatiblePeer, InvalidArgument, KVBridgeError, TransferTimeout
from ..span import KVSpan
from ..transport.tcp.kvio import KVSource
from ..transport.tcp.sender import TcpSender
from .handles import Delivery, DeliveryStats, count_outcome
from .layerwise import LayerwiseSource
from .ticket import Ticket, TicketTransport

__all__ = [
    "Destination",
    "DestinationStats",
    "LayerFeed",
    "TcpDestination",
    "UcxDestination",
]


@dataclass
class DestinationStats:
    """What one destination moved: ``sends`` started, ``bytes`` delivered
    (raw KV bytes of the sends that succeeded), ``failed`` sends."""

    sends: int = 0
    bytes: int = 0
    failed: int = 0


class LayerFeed(abc.ABC):
    """One destination's share of a layer-wise send."""

    @abc.abstractmethod
    def release(self, layer_end: int) -> None:
        """Layers below ``layer_end`` are computed: let them leave."""

    @abc.abstractmethod
    def end(self, exc: KVBridgeError) -> None:
        """Stop: what is in flight fails with ``exc``, the receiver is told."""

    @abc.abstractmethod
    def unreleased(self) -> int | None:
        """The first layer not released yet; None when all were."""

    @abc.abstractmethod
    async def outcome(self, ended: Callable[[], KVBridgeError | None]) -> DeliveryStats:
        """The destination's result once every layer left (or the send ended:
        ``ended()`` is the error it ended with)."""


class Destination(abc.ABC):
    """A connected destination of one transport."""

    transport: TicketTransport

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = DestinationStats()

    def check_ticket(self, t: Ticket) -> None:
        """Refuse a ticket this destination cannot serve (typed error)."""
        if t.transport is not self.transport:
            raise InvalidArgument(
                f"{self.name}: ticket is for {t.transport.name} "
                f"but the destination uses {self.transport.name}"
            )

    @abc.abstractmethod
    def send(
        self,
        rid: str,
        cache: Any,
        span: KVSpan,
        t: Ticket,
        *,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Delivery:
        """Send ``span`` of our cache (our pages; the tokens, layers and heads
        that ticket ``t`` asks for, or a layer range of them) to ``t``'s
        expectation."""

    @abc.abstractmethod
    def layerwise(
        self,
        rid: str,
        cache: Any,
        span: KVSpan,
        t: Ticket,
        *,
        priority: int,
        timeout: float | None,
        layer_timeout: float,
    ) -> LayerFeed:
        """Start a send of ``span`` whose layers leave as
        :meth:`LayerFeed.release` allows."""

    @abc.abstractmethod
    def abort(self, rid: str, exc: KVBridgeError) -> None:
        """Tell the receiver that send ``rid`` will not come."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def _counted(self, d: Delivery) -> Delivery:
        self.stats.sends += 1
        count_outcome(d, self.stats)
        return d


# ---- TCP -----------------------------------------------------------------------------
class TcpDestination(Destination):
    transport = TicketTransport.TCP

    def __init__(self, name: str, sender: TcpSender) -> None:
        super().__init__(name)
        self.sender = sender

    def _deliver(
        self, rid: str, src: KVSource, t: Ticket, priority: int, timeout: float | None
    ) -> Delivery:
        h = self.sender.send(rid, src, token=t.token, priority=priority, timeout=timeout)
        stats = DeliveryStats(rid, self.name, "tcp", bytes=src.nbytes)

        def finish(res: Any, st: DeliveryStats) -> None:
            st.wire_bytes = res.wire_bytes
            st.retries = res.retries
            st.streams = res.streams

        return self._counted(Delivery(stats, h.wait(), lambda: h.progress, h.cancel, finish))

    def send(
        self,
        rid: str,
        cache: Any,
        span: KVSpan,
        t: Ticket,
        *,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Delivery:
        return self._deliver(rid, KVSource(cache, span), t, priority, timeout)

    def layerwise(
        self,
        rid: str,
        cache: Any,
        span: KVSpan,
        t: Ticket,
        *,
        priority: int,
        timeout: float | None,
        layer_timeout: float,
    ) -> LayerFeed:
        src = LayerwiseSource(cache, span, layer_timeout=layer_timeout)
        d = self._deliver(rid, src, t, priority, timeout)
        # a transfer that ended early must not leave a pack waiting for its layers
        d.add_done_callback(lambda _d: src.cancel())
        return _TcpFeed(src, d)

    def abort(self, rid: str, exc: KVBridgeError) -> None:
        """A TCP receiver has nothing open for a send that never started (its
        engine cancels the expectation when the prefill reports the error)."""

    async def close(self) -> None:
        await self.sender.close()


class _TcpFeed(LayerFeed):
    """One transfer whose source releases its layers."""

    def __init__(self, src: LayerwiseSource, d: Delivery) -> None:
        self.src = src
        self.delivery = d

    def release(self, layer_end: int) -> None:
        src = self.src
        src.mark_ready(min(max(layer_end, src.layers[0]), src.layers[1]))

    def end(self, exc: KVBridgeError) -> None:
        self.src.cancel()
        self.delivery.fail(exc)

    def unreleased(self) -> int | None:
        return None  # the transfer waits (bounded by layer_timeout) by itself

    async def outcome(self, ended: Callable[[], KVBridgeError | None]) -> DeliveryStats:
        return await self.delivery


# ---- UCX -----------------------------------------------------------------------------
class UcxDestination(Destination):
    """A UCX peer; ``reconnect`` (given when the destination has a metadata
    endpoint) makes a new peer for the next incarnation of the receiver."""

    transport = TicketTransport.UCX

    def __init__(
        self,
        name: str,
        peer: Any,
        reconnect: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        super().__init__(name)
        self.peer = peer
        self._reconnect = reconnect
        self._healing: asyncio.Future[Any] | None = None

    @property
    def healable(self) -> bool:
        return self._reconnect is not None

    def check_ticket(self, t: Ticket) -> None:
        super().check_ticket(t)
        if self.peer.agent_id != t.agent_id and not self.healable:
            # (a destination that can be reconnected checks the agent once reconnected)
            raise IncompatiblePeer(f"{self.name}: the ticket names another UCX agent")

    def _heal(self) -> asyncio.Future[Any]:
        """Reconnect (once for all the sends that ask meanwhile): a new peer
        replaces the dead one."""
        f = self._healing
        if f is None or f.done():
            assert self._reconnect is not None
            reconnect = self._reconnect

            async def heal() -> Any:
                p = await reconnect()
                old = self.peer
                if old is not None and old is not p and old.error is None:
                    await old.close()  # a live peer of an older incarnation
                self.peer = p
                return p

            f = asyncio.ensure_future(heal())
            f.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._healing = f
        return f

    def send(
        self,
        rid: str,
        cache: Any,
        span: KVSpan,
        t: Ticket,
        *,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Delivery:
        stats = DeliveryStats(rid, self.name, "ucx")

        def finish(res: Any, st: DeliveryStats) -> None:
            st.bytes = int(getattr(res, "bytes", 0))
            st.wire_bytes = st.bytes
            st.path = "ucx-" + str(getattr(res, "path", "") or "put")

        def post(p: Any, seconds: float | None) -> Any:
            return p.send(rid, span, list(t.block_table), timeout=seconds)

        peer = self.peer
        stale = peer.error is not None or peer.agent_id != t.agent_id
        if not (stale and self.healable):
            h = post(peer, timeout)
            return self._counted(
                Delivery(stats, h.wait(), lambda: 1.0 if h.done() else 0.0, h.cancel, finish)
            )
        # the peer is gone (or the ticket names its next incarnation): reconnect, then send
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[str] = loop.create_future()
        box: list[Any] = []
        t0 = loop.time()
        name = self.name

        async def healed() -> Any:
            heal = self._heal()
            done, _ = await asyncio.wait(
                {heal, stop}, timeout=timeout, return_when="FIRST_COMPLETED"
            )
            if stop in done:
                raise Cancelled(stop.result())
            if heal not in done:
                raise TransferTimeout(f"{name}: {rid!r}: no reconnection within {timeout} s")
            p = heal.result()  # its typed error when the reconnection failed
            if p.agent_id != t.agent_id:
                raise IncompatiblePeer(f"{name}: the ticket names another UCX agent")
            left = None if timeout is None else max(0.0, timeout - (loop.time() - t0))
            h = post(p, left)
            box.append(h)
            return await h.wait()

        def cancel(reason: str) -> None:
            if box:
                box[0].cancel(reason)
            elif not stop.done():
                stop.set_result(reason)

        return self._counted(
            Delivery(stats, healed(), lambda: 1.0 if box and box[0].done() else 0.0, cancel, finish)
        )

    def layerwise(
        self,
        rid: str,
        cache: Any,
        span: KVSpan,
        t: Ticket,
        *,
        priority: int,
        timeout: float | None,
        layer_timeout: float,
    ) -> LayerFeed:
        return _UcxFeed(self, rid, cache, span, t, timeout)

    def abort(self, rid: str, exc: KVBridgeError) -> None:
        """An ABORT with the error's code: the receiver's expectation fails
        now rather than at its deadline."""
        peer = self.peer
        if peer is not None and peer.error is None:
            with contextlib.suppress(KVBridgeError):
                peer.abort(rid, exc)

    async def close(self) -> None:
        if self._healing is not None:
            self._healing.cancel()
            await asyncio.gather(self._healing, return_exceptions=True)
            self._healing = None
        await self.peer.close()


class _UcxFeed(LayerFeed):
    """Each released layer range is one more part (one more put batch)."""

    def __init__(
        self,
        dest: UcxDestination,
        rid: str,
        cache: Any,
        span: KVSpan,
        t: Ticket,
        timeout: float | None,
    ) -> None:
        self.dest = dest
        self.rid = rid
        self.cache = cache
        self.span = span
        self.t = t
        self.timeout = timeout
        self.parts: list[Delivery] = []
        self.sent = t.layer_start
        self.released = asyncio.Event()
        if t.layer_start == t.layer_end:
            self.released.set()

    def release(self, layer_end: int) -> None:
        t = self.t
        lo, hi = self.sent, min(layer_end, t.layer_end)
        if hi <= lo:
            return
        try:
            part = self.span.replace(layers=(lo, hi))
            d = self.dest.send(self.rid, self.cache, part, t, timeout=self.timeout)
        except KVBridgeError as exc:
            # refused to post (the receiver aborted the request, the peer
            # is gone): this destination ends with the error, no layer follows
            d = _failed(DeliveryStats(self.rid, self.dest.name, "ucx"), exc)
            hi = t.layer_end
        self.parts.append(d)
        self.sent = hi
        if hi == t.layer_end:
            self.released.set()

    def end(self, exc: KVBridgeError) -> None:
        pending = [d for d in self.parts if not d.done()]
        for d in pending:
            d.fail(exc)
        if not pending and self.sent < self.t.layer_end:
            # no part in flight, yet the receiver waits for layers that will
            # not come: an ABORT tells it (a gone peer's expect fails by itself)
            self.dest.abort(self.rid, Cancelled(str(exc)))
        self.released.set()

    def unreleased(self) -> int | None:
        return self.sent if self.sent < self.t.layer_end else None

    async def outcome(self, ended: Callable[[], KVBridgeError | None]) -> DeliveryStats:
        await self.released.wait()
        total = DeliveryStats(self.rid, self.dest.name, "ucx")
        for d in list(self.parts):
            st = await d
            total.bytes += st.bytes
            total.wire_bytes += st.wire_bytes
            total.seconds = max(total.seconds, st.seconds)
            total.path = st.path
        if self.sent < self.t.layer_end:
            exc = ended()
            assert exc is not None
            raise exc
        return total


def _failed(stats: DeliveryStats, exc: KVBridgeError) -> Delivery:
    async def fail() -> None:
        raise exc

    return Delivery(stats, fail(), lambda: 0.0, lambda _reason: None)
