"""The prefill side of the bridge: one send feeds every destination.

Every send takes a lease on its request's pages (:mod:`kvbridge.bridge.leases`):
the group's ``on_done`` callbacks run, and the lease is released, once every
destination has finished; a lease that runs out first aborts the send at both
ends with :class:`~kvbridge.errors.LeaseExpired`.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import (
    Cancelled,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    LayoutError,
    LeaseExpired,
    Unavailable,
)
from ..pack import PagedKVCache
from ..span import KVSpan
from ..transport.tcp.sender import DEFAULT_STREAMS, TcpSender
from .destination import Destination, TcpDestination, UcxDestination
from .handles import Delivery, DeliveryStats, MultiSend, Outcome, SendGroup
from .identity import check_peer, describe, unwrap_ucx_metadata, wrap_ucx_metadata
from .layerwise import LayerFeed, LayerwiseSend
from .leases import DEFAULT_LEASE, LeaseTable
from .metrics import BridgeMetrics, BridgeMetricsView
from .peers import ResolvedPeers
from .ticket import Ticket, TicketTransport

if TYPE_CHECKING:
    from ..registry.view import Resolver

__all__ = ["LayerwiseSend", "PeerConfig", "PrefillBridge"]


@dataclass(frozen=True)
class PeerConfig:
    """How to reach one destination.  ``transport`` is chosen per destination
    by configuration: "ucx" inside the datacenter, "tcp" across the WAN.

    A UCX destination is given by its ``metadata``, or by ``host`` and
    ``port`` of the endpoint where the decode serves it
    (``DecodeBridge(ucx_control=...)``).  With the address, a destination
    whose peer is gone (its endpoint failed, it stopped answering, or a
    ticket names a new incarnation of it) is reconnected on the next send to
    it, with the metadata fetched again: a restarted decode needs no restart
    of the prefill.  TCP destinations reconnect by themselves (the sender's
    connections are re-opened as long as transfers need them)."""

    transport: str
    host: str = ""
    port: int = 0  # UCX: the decode's metadata endpoint (DecodeBridge(ucx_control=...))
    metadata: bytes = b""  # UCX: the decode's registration blob
    streams: int = DEFAULT_STREAMS
    chunk_size: int | None = None  # None: fitted to the link (TcpSender), at most 4 MiB
    compression: str = "auto"
    psk: bytes | None = None
    ssl: _ssl.SSLContext | None = None
    server_hostname: str | None = None
    expected_peer: str | None = None
    connect_timeout: float = 10.0
    keepalive_interval: float = 5.0
    keepalive_timeout: float = 20.0
    reconnect_timeout: float = 30.0  # after a connection drops, before PeerGone


class PrefillBridge:
    """What a prefill engine embeds.  Connect named destinations, then
    ``send(request_id, block_table, {name: ticket, ...})``.

    ``model_id`` names the model the engine serves (a name or a digest of the
    weights); a destination serving another model, or with another KV
    dtype, layer count or heads, is refused at connect with a message that
    says what differs.  ``lease_timeout`` is the default lease of a send's
    pages; ``clock`` the lease clock (``time.monotonic``; tests pass a fake).
    ``ucx_agent`` shares one UCX agent with a :class:`DecodeBridge` over the
    same cache (an engine that both sends and receives).

    ``resolver`` (a :class:`~kvbridge.registry.RegistryView`, or any
    :class:`~kvbridge.registry.Resolver`) lets tickets name destinations
    by engine id alone: :meth:`reach` (and :meth:`send_resolved`) connects
    the named decode on demand, with ``peer_defaults`` (a TCP
    :class:`PeerConfig`; host and port come from the resolver), refuses one
    registered with another compatibility hash before connecting, and
    reconnects when its generation changes (:mod:`kvbridge.bridge.peers`).
    Destinations connected by :meth:`connect` (static peers) work as
    before, beside the resolved ones."""

    def __init__(
        self,
        cache: PagedKVCache,
        *,
        identity: str = "prefill",
        model_id: str = "",
        ucx_options: dict[str, Any] | None = None,
        ucx_agent: Any = None,
        lease_timeout: float = DEFAULT_LEASE,
        clock: Callable[[], float] = time.monotonic,
        metrics: BridgeMetrics | BridgeMetricsView | None = None,
        resolver: Resolver | None = None,
        peer_defaults: PeerConfig | None = None,
    ) -> None:
        self.cache = cache
        self.layout = cache.layout
        self.identity = identity
        self.model_id = model_id
        self.description = describe(self.layout, model_id)
        self.leases = LeaseTable(lease_timeout, clock)
        self.metrics = _view(metrics, identity, model_id)
        self._ucx_options = ucx_options or {}
        self._ucx: Any = ucx_agent
        self._own_ucx = ucx_agent is None
        self._dests: dict[str, Destination] = {}
        self._live: dict[str, SendGroup] = {}
        self._lease_timer: asyncio.TimerHandle | None = None
        self.resolved: ResolvedPeers | None = None
        if resolver is not None:
            self.resolved = ResolvedPeers(
                resolver, peer_defaults or PeerConfig("tcp"), self.layout.compat_hash
            )

    # ---- peers -------------------------------------------------------------------
    async def connect(self, name: str, peer: PeerConfig) -> None:
        if name in self._dests:
            raise InvalidArgument(f"destination {name!r} is already connected")
        if peer.transport == "tcp":
            s = TcpSender(
                peer.host,
                peer.port,
                streams=peer.streams,
                chunk_size=peer.chunk_size,
                identity=self.identity,
                compat_hash=self.layout.compat_hash,
                psk=peer.psk,
                ssl=peer.ssl,
                server_hostname=peer.server_hostname,
                expected_peer=peer.expected_peer,
                connect_timeout=peer.connect_timeout,
                keepalive_interval=peer.keepalive_interval,
                keepalive_timeout=peer.keepalive_timeout,
                reconnect_timeout=peer.reconnect_timeout,
                compression=peer.compression,
                description=self.description,
            )
            try:
                await s.connect()
            except BaseException:
                await s.close()
                raise
            self._dests[name] = TcpDestination(name, s)
        elif peer.transport == "ucx":
            if not peer.metadata and not peer.port:
                raise InvalidArgument(
                    f"{name}: a UCX destination needs its metadata or the host and port "
                    "where it serves it"
                )
            p = await self._connect_ucx(name, peer)
            # a destination with a metadata endpoint is reconnected through it
            reconnect = (lambda: self._connect_ucx(name, peer, fetch=True)) if peer.port else None
            self._dests[name] = UcxDestination(name, p, reconnect)
        else:
            raise InvalidArgument(f"unknown transport {peer.transport!r} (use 'tcp' or 'ucx')")

    async def _connect_ucx(self, name: str, peer: PeerConfig, fetch: bool = False) -> Any:
        raw = peer.metadata
        if fetch or not raw:
            from ..transport.ucx.control import fetch_metadata

            raw = await fetch_metadata(peer.host, peer.port, peer.connect_timeout)
        theirs, blob = unwrap_ucx_metadata(raw)
        if theirs is not None:
            check_peer(name, theirs, self.description)
        agent = self._ensure_ucx()
        return await agent.connect(blob, timeout=peer.connect_timeout, psk=peer.psk)

    def _ensure_ucx(self) -> Any:
        if self._ucx is None:
            from ..transport import ucx as _ucx

            if not _ucx.available():
                raise Unavailable(f"UCX transport requested: {_ucx.unavailable_reason()}")
            opts = {"identity": self.identity, **self._ucx_options}
            self._ucx = _ucx.UcxAgent(self.layout, self.cache, **opts)
            self._ucx.start()
        return self._ucx

    def ucx_metadata(self) -> bytes:
        """The bridge's UCX metadata: its description around the agent's blob
        (docs/protocol.md 8.4)."""
        return wrap_ucx_metadata(self.description, bytes(self._ensure_ucx().metadata()))

    def tcp_sender(self, name: str) -> TcpSender:
        """The TCP sender of a destination (for CONTROL messages)."""
        d = self._dests.get(name)
        if not isinstance(d, TcpDestination):
            raise InvalidArgument(f"no TCP destination named {name!r}")
        return d.sender

    def destination(self, name: str) -> Destination:
        """The connected destination ``name`` (its transport's
        :class:`~kvbridge.bridge.destination.Destination`)."""
        try:
            return self._dests[name]
        except KeyError:
            raise InvalidArgument(f"no destination named {name!r}; connect it first") from None

    async def disconnect(self, name: str) -> None:
        """Close destination ``name`` (its connection or UCX peer); the name
        can be connected again."""
        if self.resolved is not None:
            self.resolved.forget(name)
        d = self._dests.pop(name, None)
        if d is not None:
            await d.close()

    async def reach(self, name: str) -> None:
        """Make sure destination ``name`` is connected, to the incarnation
        the resolver names now.  A static destination (:meth:`connect`) is
        left as it is.  Through the resolver: ``UnknownPeer`` when no live
        entry names it, :class:`~kvbridge.errors.IncompatiblePeer` when its
        entry has another compatibility hash (nothing connects); a
        destination whose entry changed generation or address is closed
        (sends still on it fail) and connected again; the handshake's
        errors (``AuthenticationError`` for a peer that is not ``name``)
        pass through and leave nothing connected."""
        rp = self.resolved
        if rp is None or (name in self._dests and not rp.is_bound(name)):
            self.destination(name)  # static, or InvalidArgument
            return
        async with rp.lock(name):
            if name not in self._dests:
                rp.forget(name)
            addr, peer = rp.plan(name)
            if peer is None:
                return
            old = self._dests.pop(name, None)
            if old is not None:
                await old.close()
            try:
                await self.connect(name, peer)
            except BaseException:
                rp.forget(name)
                raise
            rp.bind(name, addr)

    async def send_resolved(
        self,
        request_id: str | int,
        block_table: Any,
        tickets: Mapping[str, bytes | Ticket],
        **kw: Any,
    ) -> MultiSend:
        """:meth:`reach` every destination the tickets name, then :meth:`send`."""
        for name in tickets:
            await self.reach(name)
        return self.send(request_id, block_table, tickets, **kw)

    @property
    def destinations(self) -> list[str]:
        return list(self._dests)

    @property
    def live_sends(self) -> dict[str, SendGroup]:
        """The sends that hold a lease now, by request id."""
        return dict(self._live)

    async def close(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        for group in list(self._live.values()):
            group.fail(Cancelled("prefill bridge closed"))
        # TCP first, then UCX (the peers before the agent they belong to)
        dests = sorted(self._dests.values(), key=lambda d: d.transport is TicketTransport.UCX)
        self._dests.clear()
        for d in dests:
            await d.close()
        if self._ucx is not None and self._own_ucx:
            await self._ucx.close()
        self._ucx = None

    async def __aenter__(self) -> PrefillBridge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- sending -----------------------------------------------------------------
    def _ticket(self, name: str, raw: bytes | Ticket, *, known: bool = True) -> Ticket:
        t = raw if isinstance(raw, Ticket) else Ticket.decode(raw)
        if t.compat_hash != self.layout.compat_hash:
            raise IncompatiblePeer(
                f"{name}: the ticket's layout hash {t.compat_hash:#x} is not ours "
                f"({self.layout.compat_hash:#x}: {self.layout.wire_key()})"
            )
        if t.model and self.model_id and t.model != self.model_id:
            raise IncompatiblePeer(
                f"{name}: the ticket is for model {t.model!r} != ours {self.model_id!r}"
            )
        if known:
            self.destination(name).check_ticket(t)
        self.send_heads(name, t)
        return t

    def send_heads(self, name: str, t: Ticket) -> tuple[int, int]:
        """The heads this bridge sends for ticket ``t``: the intersection of
        the heads the ticket asks for (all the model's when it names none) and
        those this cache holds.  An empty intersection is a
        :class:`~kvbridge.errors.LayoutError` (nothing of it is here)."""
        total = self.layout.total_kv_heads
        a, b = t.heads if t.heads is not None else (0, total)
        if b > total:
            raise LayoutError(
                f"{name}: the ticket asks for heads [{a}, {b}) of a model with {total} KV heads"
            )
        c, d = self.layout.head_range
        lo, hi = max(a, c), min(b, d)
        if lo >= hi:
            raise LayoutError(
                f"{name}: the ticket asks for heads [{a}, {b}) and this cache holds [{c}, {d}): "
                "no head in common"
            )
        return (lo, hi)

    def _checked(
        self, rid: str, pages: Any, tickets: Mapping[str, bytes | Ticket]
    ) -> dict[str, tuple[Ticket, KVSpan]]:
        """Every ticket decoded and checked, and the span each destination
        gets, before anything is sent."""
        out = {n: self._ticket(n, raw) for n, raw in tickets.items()}
        for name, t in out.items():
            if t.request_id != rid:
                raise InvalidArgument(
                    f"{name}: ticket is for request {t.request_id!r}, not {rid!r}"
                )
        if rid in self._live:
            raise InvalidArgument(f"request {rid!r} is being sent already (it holds a lease)")
        bound = pages if isinstance(pages, KVSpan) else None
        table = bound if bound is not None else KVSpan(pages, 0, 0)  # copied once
        return {n: (t, self._span(n, table, bound, t)) for n, t in out.items()}

    def check_send(
        self,
        request_id: str | int,
        block_table: Any,
        tickets: Mapping[str, bytes | Ticket],
        *,
        reach_later: bool = False,
    ) -> tuple[Any, dict[str, Ticket]]:
        """The checks :meth:`send` makes before anything moves, alone: every
        ticket decoded and checked against this bridge and its destination,
        each destination's span against the cache
        (:class:`~kvbridge.errors.PageIndexError`).  It reads only state that
        a connect or disconnect replaces whole, so any thread may call it
        (:class:`~kvbridge.bridge.sync.SyncBridge` does, in the engine's).
        ``reach_later``: a destination not connected yet is one
        :meth:`reach` will connect; its ticket is checked but for the
        destination's own rules, which :meth:`send` checks.  Whether the
        request is being sent already is not checked here.  Returns what
        :meth:`send` may be given instead: the block table (the span given,
        or a private read-only copy of the table) and the decoded tickets."""
        rid = str(request_id)
        dests = self._dests
        bound = block_table if isinstance(block_table, KVSpan) else None
        table = bound if bound is not None else KVSpan(block_table, 0, 0)
        out: dict[str, Ticket] = {}
        for name, raw in tickets.items():
            t = self._ticket(name, raw, known=not reach_later or name in dests)
            if t.request_id != rid:
                raise InvalidArgument(
                    f"{name}: ticket is for request {t.request_id!r}, not {rid!r}"
                )
            self._span(name, table, bound, t).check(self.cache)
            out[name] = t
        return (bound if bound is not None else table.block_table), out

    def _span(self, name: str, table: KVSpan, bound: KVSpan | None, t: Ticket) -> KVSpan:
        """What we send for ticket ``t``: our pages, the ticket's tokens and
        layers, the heads :meth:`send_heads` says.  A span the engine gave
        bounds them: the ticket may not ask for tokens, layers or heads
        outside it (its pages do not hold them)."""
        heads = self.send_heads(name, t)
        span = table.replace(
            start=t.start, end=t.end, layers=(t.layer_start, t.layer_end), heads=heads
        )
        if bound is not None:
            b = bound.resolve(self.layout)
            assert b.layers is not None and b.heads is not None
            if not (
                b.start <= t.start
                and t.end <= b.end
                and b.layers[0] <= t.layer_start
                and t.layer_end <= b.layers[1]
                and b.heads[0] <= heads[0]
                and heads[1] <= b.heads[1]
            ):
                raise InvalidArgument(
                    f"{name}: the ticket asks for tokens [{t.start}, {t.end}) of layers "
                    f"[{t.layer_start}, {t.layer_end}), heads {list(heads)}, outside the "
                    f"span given ({bound!r})"
                )
        return span

    def send(
        self,
        request_id: str | int,
        block_table: Any,
        tickets: Mapping[str, bytes | Ticket],
        *,
        priority: int = 0,
        timeout: float | None = 60.0,
        lease: float | None = None,
        granted_at: float | None = None,
    ) -> MultiSend:
        """Send the KV each ticket asks for, to every destination at once.
        Each destination progresses and completes on its own.  ``lease``: how
        long the pages stay pinned for this send (default ``lease_timeout``).
        ``block_table``: our pages of the request, or a
        :class:`~kvbridge.span.KVSpan` of them, which also bounds the tokens,
        layers and heads a ticket may ask for (``InvalidArgument`` before
        anything moves otherwise).  ``granted_at``: the lease counts from
        that time of the lease clock (the caller's call; default now)."""
        rid = str(request_id)
        checked = self._checked(rid, block_table, tickets)
        self.leases.grant(rid, lease, now=granted_at)
        out: dict[str, Delivery] = {}
        try:
            for name, (t, span) in checked.items():
                out[name] = self._dests[name].send(
                    rid, self.cache, span, t, priority=priority, timeout=timeout
                )
        except BaseException as exc:
            self.leases.release(rid)
            for d in out.values():
                d.cancel("the send failed to start")
            if isinstance(exc, KVBridgeError):
                self._refused(rid, [n for n in checked if n not in out], exc)
            raise
        group = MultiSend(rid, out)
        self._track(group)
        return group

    def _refused(self, rid: str, names: list[str], exc: KVBridgeError) -> None:
        """A send that failed to post: its receivers are told (UCX: an ABORT
        with the error's code), so their expectations fail now rather than at
        their deadlines.  (A TCP receiver has nothing open for it yet; its
        engine cancels the expectation when the prefill reports the error.)"""
        for name in names:
            d = self._dests.get(name)
            if d is not None:
                d.abort(rid, exc)

    def send_layerwise(
        self,
        request_id: str | int,
        block_table: Any,
        tickets: Mapping[str, bytes | Ticket],
        *,
        priority: int = 0,
        timeout: float | None = 60.0,
        layer_timeout: float = 30.0,
        lease: float | None = None,
        granted_at: float | None = None,
    ) -> LayerwiseSend:
        """Start a send whose layers leave as prefill finishes them: call
        :meth:`LayerwiseSend.layers_ready` after each layer (or group).
        ``block_table`` as in :meth:`send` (a table or a span)."""
        rid = str(request_id)
        checked = self._checked(rid, block_table, tickets)
        self.leases.grant(rid, lease, now=granted_at)
        feeds: dict[str, LayerFeed] = {}
        try:
            for name, (t, span) in checked.items():
                feeds[name] = self._dests[name].layerwise(
                    rid, self.cache, span, t,
                    priority=priority, timeout=timeout, layer_timeout=layer_timeout,
                )  # fmt: skip
        except BaseException as exc:
            self.leases.release(rid)
            err = exc if isinstance(exc, KVBridgeError) else Cancelled("the send failed to start")
            for f in feeds.values():
                f.end(err)
            raise
        group = LayerwiseSend(rid, self.layout.num_layers, feeds)
        self._track(group)
        return group

    # ---- leases ------------------------------------------------------------------
    def _track(self, group: SendGroup) -> None:
        rid = group.request_id
        self._live[rid] = group
        m = self.metrics
        for _ in group.destinations:
            m.started("send")

        def one(name: str, out: Outcome) -> None:
            if isinstance(out, DeliveryStats):
                m.finished("send", out)
            else:
                m.failed("send", out)

        def done(_g: SendGroup) -> None:
            if self._live.get(rid) is group:
                del self._live[rid]
                self.leases.release(rid)
                self._arm_leases()

        group.on_outcome(one)
        group.on_done(done)
        self._arm_leases()

    def renew_lease(
        self, request_id: str | int, seconds: float | None = None, *, at: float | None = None
    ) -> bool:
        """Extend a running send's lease to ``seconds`` from now (None: the
        length it was granted with; ``at``: from that time of the lease
        clock instead of now).  False when the request holds no lease (its
        send has ended): nothing is pinned any more."""
        ok = self.leases.renew(str(request_id), seconds, now=at) is not None
        if ok:
            self._arm_leases()
        return ok

    def expire_leases(self) -> list[str]:
        """Abort, at both ends, every send whose lease has run out (the lease
        timer calls this); returns their request ids."""
        out = []
        for lease in self.leases.pop_expired():
            group = self._live.pop(lease.request_id, None)
            if group is None:
                continue
            out.append(lease.request_id)
            self.metrics.lease_expired()
            renewed = f", renewed {lease.renewals} times" if lease.renewals else ""
            group.fail(
                LeaseExpired(
                    f"the lease on the pages of request {lease.request_id!r} ran out "
                    f"({lease.seconds:g} s{renewed}) before its send finished; "
                    "aborted at both ends"
                )
            )
        self._arm_leases()
        return out

    def _arm_leases(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        deadline = self.leases.next_deadline
        if deadline is None:
            return
        delay = max(0.0, deadline - self.leases.clock())
        self._lease_timer = asyncio.get_running_loop().call_later(delay, self.expire_leases)


def _view(
    metrics: BridgeMetrics | BridgeMetricsView | None, identity: str, model_id: str
) -> BridgeMetricsView:
    if isinstance(metrics, BridgeMetricsView):
        return metrics
    return (metrics or BridgeMetrics()).for_bridge(identity, model_id)
