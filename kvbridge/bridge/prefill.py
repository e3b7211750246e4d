"""The prefill side of the bridge: one send feeds every destination."""

from __future__ import annotations

import ssl as _ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import IncompatiblePeer, InvalidArgument, Unavailable
from ..pack import PagedKVCache
from ..transport.tcp.kvio import KVSource
from ..transport.tcp.sender import DEFAULT_STREAMS, TcpSender
from .handles import Delivery, DeliveryStats, MultiSend
from .layerwise import LayerwiseSource
from .ticket import Ticket, TicketTransport

__all__ = ["LayerwiseSend", "PeerConfig", "PrefillBridge"]


@dataclass(frozen=True)
class PeerConfig:
    """How to reach one destination.  ``transport`` is chosen per destination
    by configuration: "ucx" inside the datacenter, "tcp" across the WAN."""

    transport: str
    host: str = ""
    port: int = 0
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
    ``send(request_id, block_table, {name: ticket, ...})``."""

    def __init__(
        self,
        cache: PagedKVCache,
        *,
        identity: str = "prefill",
        ucx_options: dict[str, Any] | None = None,
    ) -> None:
        self.cache = cache
        self.layout = cache.layout
        self.identity = identity
        self._ucx_options = ucx_options or {}
        self._ucx: Any = None
        self._tcp: dict[str, TcpSender] = {}
        self._ucx_peers: dict[str, Any] = {}

    # ---- peers -------------------------------------------------------------------
    async def connect(self, name: str, peer: PeerConfig) -> None:
        if name in self._tcp or name in self._ucx_peers:
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
            )
            try:
                await s.connect()
            except BaseException:
                await s.close()
                raise
            self._tcp[name] = s
        elif peer.transport == "ucx":
            agent = self._ensure_ucx()
            self._ucx_peers[name] = await agent.connect(peer.metadata, timeout=peer.connect_timeout)
        else:
            raise InvalidArgument(f"unknown transport {peer.transport!r} (use 'tcp' or 'ucx')")

    def _ensure_ucx(self) -> Any:
        if self._ucx is None:
            from ..transport import ucx as _ucx

            if not _ucx.available():
                raise Unavailable(f"UCX transport requested: {_ucx.unavailable_reason()}")
            self._ucx = _ucx.UcxAgent(self.layout, self.cache, **self._ucx_options)
            self._ucx.start()
        return self._ucx

    def ucx_metadata(self) -> bytes:
        return bytes(self._ensure_ucx().metadata())

    def tcp_sender(self, name: str) -> TcpSender:
        """The TCP sender of a destination (for CONTROL messages)."""
        try:
            return self._tcp[name]
        except KeyError:
            raise InvalidArgument(f"no TCP destination named {name!r}") from None

    @property
    def destinations(self) -> list[str]:
        return [*self._tcp, *self._ucx_peers]

    async def close(self) -> None:
        for s in self._tcp.values():
            await s.close()
        self._tcp.clear()
        for p in self._ucx_peers.values():
            await p.close()
        self._ucx_peers.clear()
        if self._ucx is not None:
            await self._ucx.close()
            self._ucx = None

    async def __aenter__(self) -> PrefillBridge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- sending -----------------------------------------------------------------
    def _ticket(self, name: str, raw: bytes | Ticket) -> Ticket:
        t = raw if isinstance(raw, Ticket) else Ticket.decode(raw)
        if t.compat_hash != self.layout.compat_hash:
            raise IncompatiblePeer(
                f"{name}: the ticket's layout hash {t.compat_hash:#x} is not ours "
                f"({self.layout.compat_hash:#x}: {self.layout.wire_key()})"
            )
        want = TicketTransport.TCP if name in self._tcp else TicketTransport.UCX
        if name not in self._tcp and name not in self._ucx_peers:
            raise InvalidArgument(f"no destination named {name!r}; connect it first")
        if t.transport is not want:
            raise InvalidArgument(
                f"{name}: ticket is for {t.transport.name} but the destination uses {want.name}"
            )
        peer = self._ucx_peers.get(name)
        if peer is not None and peer.metadata.agent_id != t.agent_id:
            raise IncompatiblePeer(f"{name}: the ticket names another UCX agent")
        return t

    def _checked(self, rid: str, tickets: Mapping[str, bytes | Ticket]) -> dict[str, Ticket]:
        """Every ticket decoded and checked before anything is sent."""
        out = {n: self._ticket(n, raw) for n, raw in tickets.items()}
        for name, t in out.items():
            if t.request_id != rid:
                raise InvalidArgument(
                    f"{name}: ticket is for request {t.request_id!r}, not {rid!r}"
                )
        return out

    def send(
        self,
        request_id: str | int,
        block_table: Any,
        tickets: Mapping[str, bytes | Ticket],
        *,
        priority: int = 0,
        timeout: float | None = 60.0,
    ) -> MultiSend:
        """Send the KV each ticket asks for, to every destination at once.
        Each destination progresses and completes on its own."""
        rid = str(request_id)
        out: dict[str, Delivery] = {}
        for name, t in self._checked(rid, tickets).items():
            if name in self._tcp:
                src = KVSource(
                    self.cache, block_table, t.start, t.end, (t.layer_start, t.layer_end)
                )
                out[name] = self._tcp_delivery(name, rid, src, t, priority, timeout)
            else:
                out[name] = self._ucx_delivery(name, rid, block_table, t, None, timeout)
        return MultiSend(rid, out)

    def send_layerwise(
        self,
        request_id: str | int,
        block_table: Any,
        tickets: Mapping[str, bytes | Ticket],
        *,
        priority: int = 0,
        timeout: float | None = 60.0,
        layer_timeout: float = 30.0,
    ) -> LayerwiseSend:
        """Start a send whose layers leave as prefill finishes them: call
        :meth:`LayerwiseSend.layers_ready` after each layer (or group)."""
        rid = str(request_id)
        checked = self._checked(rid, tickets)
        return LayerwiseSend(self, rid, block_table, checked, priority, timeout, layer_timeout)

    def _tcp_delivery(
        self,
        name: str,
        rid: str,
        src: KVSource,
        t: Ticket,
        priority: int,
        timeout: float | None,
    ) -> Delivery:
        h = self._tcp[name].send(rid, src, token=t.token, priority=priority, timeout=timeout)
        stats = DeliveryStats(rid, name, "tcp", bytes=src.nbytes)

        def finish(res: Any, st: DeliveryStats) -> None:
            st.wire_bytes = res.wire_bytes
            st.retries = res.retries
            st.streams = res.streams

        return Delivery(stats, h.wait(), lambda: h.progress, h.cancel, finish)

    def _ucx_delivery(
        self,
        name: str,
        rid: str,
        block_table: Any,
        t: Ticket,
        layers: tuple[int, int] | None,
        timeout: float | None,
    ) -> Delivery:
        peer = self._ucx_peers[name]
        h = peer.send(
            rid,
            block_table,
            list(t.block_table),
            t.start,
            t.end,
            layers or (t.layer_start, t.layer_end),
            timeout=timeout,
        )
        stats = DeliveryStats(rid, name, "ucx")

        def finish(res: Any, st: DeliveryStats) -> None:
            st.bytes = int(getattr(res, "bytes", 0))
            st.wire_bytes = st.bytes
            st.path = "ucx-" + str(getattr(res, "path", "") or "put")

        return Delivery(stats, h.wait(), lambda: 1.0 if h.done() else 0.0, h.cancel, finish)


class LayerwiseSend:
    """A send whose layers are released as prefill computes them."""

    def __init__(
        self,
        bridge: PrefillBridge,
        rid: str,
        block_table: Any,
        tickets: dict[str, Ticket],
        priority: int,
        timeout: float | None,
        layer_timeout: float,
    ) -> None:
        self.bridge = bridge
        self.request_id = rid
        self.block_table = block_table
        self.tickets = tickets
        self.timeout = timeout
        self._sources: dict[str, LayerwiseSource] = {}
        self._ucx_parts: dict[str, list[Delivery]] = {
            n: [] for n in tickets if n not in bridge._tcp
        }
        self._ucx_sent: dict[str, int] = {n: tickets[n].layer_start for n in self._ucx_parts}
        self._tcp: dict[str, Delivery] = {}
        for name, t in tickets.items():
            if name in bridge._tcp:
                src = LayerwiseSource(
                    bridge.cache,
                    block_table,
                    t.start,
                    t.end,
                    (t.layer_start, t.layer_end),
                    layer_timeout=layer_timeout,
                )
                self._sources[name] = src
                self._tcp[name] = bridge._tcp_delivery(name, rid, src, t, priority, timeout)

    def layers_ready(self, layer_end: int) -> None:
        """Layers below ``layer_end`` are computed: let them leave."""
        if not 0 <= layer_end <= self.bridge.layout.num_layers:
            raise InvalidArgument(f"layer {layer_end} outside [0, {self.bridge.layout.num_layers}]")
        for src in self._sources.values():
            src.mark_ready(min(max(layer_end, src.layers[0]), src.layers[1]))
        for name, parts in self._ucx_parts.items():
            t = self.tickets[name]
            lo, hi = self._ucx_sent[name], min(layer_end, t.layer_end)
            if hi > lo:
                parts.append(
                    self.bridge._ucx_delivery(
                        name, self.request_id, self.block_table, t, (lo, hi), self.timeout
                    )
                )
                self._ucx_sent[name] = hi

    def cancel(self, reason: str = "cancelled by the sender") -> None:
        for src in self._sources.values():
            src.cancel()
        for d in self._tcp.values():
            d.cancel(reason)
        for parts in self._ucx_parts.values():
            for d in parts:
                d.cancel(reason)

    async def wait(self, timeout: float | None = None) -> dict[str, DeliveryStats]:
        """Every layer delivered to every destination (call after the last
        ``layers_ready``)."""
        out: dict[str, DeliveryStats] = {}
        for name, d in self._tcp.items():
            out[name] = await d.wait(timeout)
        for name, parts in self._ucx_parts.items():
            t = self.tickets[name]
            if self._ucx_sent[name] < t.layer_end:
                raise InvalidArgument(f"{name}: layers from {self._ucx_sent[name]} never released")
            total = DeliveryStats(self.request_id, name, "ucx")
            for d in parts:
                st = await d.wait(timeout)
                total.bytes += st.bytes
                total.wire_bytes += st.wire_bytes
                total.seconds = max(total.seconds, st.seconds)
                total.path = st.path
            out[name] = total
        return out
