"""The decode side of the bridge (relay decode and main decode)."""

from __future__ import annotations

import ssl as _ssl
from typing import Any

from ..errors import InvalidArgument, Unavailable
from ..pack import PagedKVCache
from ..transport.tcp import ReceiverLimits, TcpReceiver
from ..transport.tcp.kvio import KVSink
from .handles import Delivery, DeliveryStats
from .identity import describe, wrap_ucx_metadata
from .metrics import BridgeMetrics, BridgeMetricsView
from .prefill import _view
from .ticket import Ticket, TicketTransport

__all__ = ["DecodeBridge", "Expectation"]


class Expectation(Delivery):
    """An expected transfer: ``ticket`` goes to the prefill side; awaiting it
    returns once every byte of the range is in the pages."""

    ticket: bytes


class DecodeBridge:
    """What a relay decode or main decode embeds.

    ``tcp_listen=(host, port)`` accepts WAN (or local) TCP senders;
    ``ucx=True`` registers the cache once for one-sided UCX puts.  A transport
    that was not configured, or is not available here, raises
    :class:`~kvbridge.errors.Unavailable` when asked for; there is no silent
    fallback.

    ``model_id`` names the model the engine serves; the bridge describes
    itself with it (and its KV dtype, layers and heads) at every handshake and
    in its tickets and UCX metadata, so that a peer serving another model is
    refused with a message that says what differs.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        *,
        identity: str = "decode",
        model_id: str = "",
        tcp_listen: tuple[str, int] | None = None,
        psk: bytes | dict[str, bytes] | None = None,
        ssl: _ssl.SSLContext | None = None,
        allowed_identities: frozenset[str] | None = None,
        tls_identity: str = "cn_or_san",
        limits: ReceiverLimits | None = None,
        ucx: bool = False,
        ucx_options: dict[str, Any] | None = None,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 20.0,
        metrics: BridgeMetrics | BridgeMetricsView | None = None,
    ) -> None:
        self.cache = cache
        self.layout = cache.layout
        self.identity = identity
        self.model_id = model_id
        self.description = describe(self.layout, model_id)
        self.metrics = _view(metrics, identity, model_id)
        self._tcp: TcpReceiver | None = None
        if tcp_listen is not None:
            self._tcp = TcpReceiver(
                tcp_listen[0],
                tcp_listen[1],
                identity=identity,
                compat_hash=self.layout.compat_hash,
                psk=psk,
                ssl=ssl,
                allowed_identities=allowed_identities,
                tls_identity=tls_identity,
                limits=limits or ReceiverLimits(),
                keepalive_interval=keepalive_interval,
                keepalive_timeout=keepalive_timeout,
                description=self.description,
            )
        self._want_ucx = ucx
        self._ucx_options = ucx_options or {}
        self._ucx: Any = None

    async def start(self) -> DecodeBridge:
        if self._tcp is not None:
            await self._tcp.start()
        if self._want_ucx:
            from ..transport import ucx as _ucx

            if not _ucx.available():
                raise Unavailable(f"UCX transport requested: {_ucx.unavailable_reason()}")
            self._ucx = _ucx.UcxAgent(self.layout, self.cache, **self._ucx_options)
            self._ucx.start()
        return self

    async def close(self) -> None:
        if self._tcp is not None:
            await self._tcp.close()
        if self._ucx is not None:
            await self._ucx.close()

    async def __aenter__(self) -> DecodeBridge:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- addresses ---------------------------------------------------------------
    @property
    def tcp_address(self) -> tuple[str, int]:
        if self._tcp is None:
            raise Unavailable("this decode bridge has no TCP listener (tcp_listen=None)")
        return (self._tcp.host, self._tcp.port)

    def ucx_metadata(self) -> bytes:
        """The opaque, versioned bytes a prefill passes to connect: the
        bridge's description around its UCX agent's registration blob
        (docs/protocol.md 8.4)."""
        return wrap_ucx_metadata(self.description, bytes(self._require_ucx().metadata()))

    @property
    def ucx_agent(self) -> Any:
        """The UCX agent (ucx=True), to share with a PrefillBridge on this cache."""
        return self._require_ucx()

    @property
    def tcp(self) -> TcpReceiver:
        if self._tcp is None:
            raise Unavailable("this decode bridge has no TCP listener (tcp_listen=None)")
        return self._tcp

    def _require_ucx(self) -> Any:
        if self._ucx is None:
            raise Unavailable("this decode bridge was not started with ucx=True")
        return self._ucx

    # ---- control messages (handoff, prefix negotiation) ------------------------------
    def on_control(self, frame_type: int, handler: Any) -> None:
        """``handler(conn, frame_type, payload)`` for CONTROL frames from senders."""
        self.tcp.on_control(frame_type, handler)

    # ---- the engine API ----------------------------------------------------------
    def expect(
        self,
        request_id: str | int,
        block_table: Any,
        start: int,
        end: int,
        *,
        layers: tuple[int, int] | None = None,
        via: str = "tcp",
        timeout: float | None = 60.0,
    ) -> Expectation:
        """Expect tokens ``[start, end)`` (and ``layers``) of a request into the
        pages ``block_table``.  Give ``expectation.ticket`` to the sender."""
        rid = str(request_id)
        l0, l1 = self.layout.layer_range(layers)
        if via == "tcp":
            tcp = self.tcp
            sink = KVSink(self.cache, block_table, start, end, (l0, l1))
            h = tcp.expect(rid, sink, timeout=timeout)
            ticket = Ticket(
                TicketTransport.TCP,
                rid,
                start,
                end,
                l0,
                l1,
                self.layout.compat_hash,
                token=h.token,
                model=self.model_id,
            )
            stats = DeliveryStats(rid, self.identity, "tcp", bytes=sink.nbytes)

            def finish_tcp(_n: Any, st: DeliveryStats) -> None:
                st.wire_bytes = h.stats.wire_bytes  # the chunk bodies that arrived

            exp = Expectation(stats, h.wait(), lambda: h.progress, h.cancel, finish_tcp)
        elif via == "ucx":
            agent = self._require_ucx()
            uh = agent.expect(rid, block_table, start, end, (l0, l1), timeout=timeout)
            bt = tuple(int(x) for x in list(block_table))
            ticket = Ticket(
                TicketTransport.UCX,
                rid,
                start,
                end,
                l0,
                l1,
                self.layout.compat_hash,
                agent_id=agent.agent_id,
                block_table=bt,
                model=self.model_id,
            )
            stats = DeliveryStats(rid, self.identity, "ucx", bytes=0)

            def finish_ucx(res: Any, st: DeliveryStats) -> None:
                st.bytes = int(getattr(res, "bytes", 0))
                st.wire_bytes = st.bytes
                st.path = "ucx-" + str(getattr(res, "path", "") or "put")

            exp = Expectation(
                stats, uh.wait(), lambda: 1.0 if uh.done() else 0.0, uh.cancel, finish_ucx
            )
        else:
            raise InvalidArgument(f"unknown transport {via!r} (use 'tcp' or 'ucx')")
        exp.ticket = ticket.encode()
        m = self.metrics
        m.started("recv")

        def record(d: Delivery) -> None:
            out = d.outcome()
            if isinstance(out, DeliveryStats):
                m.finished("recv", out)
            elif out is not None:
                m.failed("recv", out)

        exp.add_done_callback(record)
        return exp
