"""One receiving transport of a decode bridge, whatever it is.

:class:`Inbound` is the receive side's seam between the bridges and the
transports, the counterpart of :mod:`kvbridge.bridge.destination`: a
:class:`~kvbridge.bridge.decode.DecodeBridge` holds one per configured
transport and expects transfers only through it.  :class:`TcpInbound`
wraps a :class:`~kvbridge.transport.tcp.TcpReceiver` (its listener);
:class:`UcxInbound` a :class:`~kvbridge.transport.ucx.UcxAgent` (public
verbs only: ``start``, ``metadata``, ``expect``, ``close``, ``agent_id``),
with the TCP endpoint that serves the bridge's UCX metadata when it has one.

The verbs: :meth:`Inbound.start` and :meth:`Inbound.close`,
:meth:`Inbound.expect` (one expected transfer of a
:class:`~kvbridge.span.KVSpan` into the cache, with the ticket the sender
needs: an :class:`Expectation`), ``endpoint`` (where senders reach it:
the TCP listener's address; the UCX metadata endpoint's, or None) and
``stats`` (what it received)."""

from __future__ import annotations

import abc
import asyncio
import os
import ssl as _ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument, Unavailable
from ..layout import KVLayout
from ..span import KVSpan
from ..transport.tcp import ReceiverLimits, TcpReceiver, new_token
from ..transport.tcp.kvio import KVSink
from .handles import Delivery, DeliveryStats, count_outcome
from .identity import wrap_ucx_metadata
from .ticket import Ticket, TicketTransport

_TOKENS_LOW, _TOKENS_BATCH = 64, 256  # tokens kept ready for prepare(), refilled on the loop

__all__ = ["Expectation", "Inbound", "InboundStats", "Prepared", "TcpInbound", "UcxInbound"]


class Expectation(Delivery):
    """An expected transfer: ``ticket`` goes to the prefill side; awaiting it
    returns once every byte of the range is in the pages.  An expectation
    of several sources (``expect(..., sources=...)``) has one ticket per
    source in ``tickets`` (by name) and its parts in ``parts``."""

    tickets: dict[str, bytes]
    parts: dict[str, Expectation]

    def set_tickets(self, tickets: dict[str, bytes]) -> None:
        self.tickets = dict(tickets)
        if not hasattr(self, "parts"):
            self.parts = {}

    @property
    def ticket(self) -> bytes:
        """The ticket of an expectation with one sender."""
        if len(self.tickets) != 1:
            raise InvalidArgument(
                f"this expectation has one ticket per source ({sorted(self.tickets)}): use .tickets"
            )
        return next(iter(self.tickets.values()))


@dataclass(frozen=True)
class Prepared:
    """An expectation made ready before it is registered: its ``ticket``
    (what the sender needs) and, over TCP, the transfer ``token`` in it.
    :meth:`Inbound.prepare` makes one in any thread from state that does not
    change while the inbound runs; :meth:`Inbound.expect` registers it later,
    on the loop."""

    span: KVSpan
    ticket: bytes
    token: bytes | None = None


@dataclass
class InboundStats:
    """What one receiving transport took: ``expected`` transfers, ``bytes``
    landed (raw KV bytes of those that completed), ``failed`` ones."""

    expected: int = 0
    bytes: int = 0
    failed: int = 0


class Inbound(abc.ABC):
    """A receiving transport of one decode bridge: it knows the cache, the
    layout and the model the tickets name."""

    transport: TicketTransport

    def __init__(self, cache: Any, identity: str, model_id: str) -> None:
        self.cache = cache
        self.layout: KVLayout = cache.layout
        self.identity = identity
        self.model_id = model_id
        self.stats = InboundStats()

    @property
    def via(self) -> str:
        """The transport's name in ``expect(via=...)``: "tcp" or "ucx"."""
        return self.transport.name.lower()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def endpoint(self) -> tuple[str, int] | None:
        """Where senders reach this transport by address (None: by metadata only)."""

    @abc.abstractmethod
    def prepare(self, rid: str, span: KVSpan) -> Prepared:
        """Check ``span`` (resolved) against the cache
        (:class:`~kvbridge.errors.PageIndexError` for a page outside it) and
        make its ticket, without registering anything: safe in any thread
        once the inbound started."""

    @abc.abstractmethod
    def expect(
        self, rid: str, span: KVSpan, timeout: float | None, prepared: Prepared | None = None
    ) -> Expectation:
        """Expect ``span`` (resolved: its heads are the ones this sender
        brings) of request ``rid``; the expectation carries its ticket
        (``prepared``'s, when given: what :meth:`prepare` made for it)."""

    def _ticket(self, rid: str, span: KVSpan, **fields: Any) -> bytes:
        assert span.layers is not None and span.heads is not None
        # the ticket names the heads unless they are all the model's (version 1 bytes)
        named = None if span.heads == (0, self.layout.total_kv_heads) else span.heads
        return Ticket(
            self.transport,
            rid,
            span.start,
            span.end,
            span.layers[0],
            span.layers[1],
            self.layout.compat_hash,
            model=self.model_id,
            heads=named,
            **fields,
        ).encode()

    def _expectation(
        self,
        stats: DeliveryStats,
        wait: Any,
        progress: Callable[[], float],
        cancel: Callable[[str], None],
        finish: Callable[[Any, DeliveryStats], None],
        ticket: bytes,
    ) -> Expectation:
        exp = Expectation(stats, wait, progress, cancel, finish)
        exp.set_tickets({"": ticket})
        self.stats.expected += 1
        count_outcome(exp, self.stats)
        return exp


# ---- TCP -----------------------------------------------------------------------------
class TcpInbound(Inbound):
    """A TCP listener: each expectation is one token of the receiver's."""

    transport = TicketTransport.TCP

    def __init__(
        self,
        cache: Any,
        identity: str,
        model_id: str,
        listen: tuple[str, int],
        *,
        description: Any,
        psk: bytes | dict[str, bytes] | None = None,
        ssl: _ssl.SSLContext | None = None,
        allowed_identities: frozenset[str] | None = None,
        tls_identity: str = "cn_or_san",
        limits: ReceiverLimits | None = None,
        keepalive_interval: float = 5.0,
        keepalive_timeout: float = 20.0,
    ) -> None:
        super().__init__(cache, identity, model_id)
        self._tokens: deque[bytes] = deque()  # fresh transfer tokens, drawn on the loop
        self.receiver = TcpReceiver(
            listen[0],
            listen[1],
            identity=identity,
            compat_hash=self.layout.compat_hash,
            psk=psk,
            ssl=ssl,
            allowed_identities=allowed_identities,
            tls_identity=tls_identity,
            limits=limits or ReceiverLimits(),
            keepalive_interval=keepalive_interval,
            keepalive_timeout=keepalive_timeout,
            description=description,
        )

    async def start(self) -> None:
        await self.receiver.start()
        self._refill()

    async def close(self) -> None:
        await self.receiver.close()

    @property
    def endpoint(self) -> tuple[str, int]:
        return (self.receiver.host, self.receiver.port)

    def prepare(self, rid: str, span: KVSpan) -> Prepared:
        span.check_pages(self.cache)
        try:  # drawn on the loop beforehand: no system call in the caller's thread
            token = self._tokens.popleft()
        except IndexError:
            token = new_token()
        return Prepared(span, self._ticket(rid, span, token=token), token)

    def _refill(self) -> None:
        """(On the loop) keep fresh random tokens ready for :meth:`prepare`,
        which may run in an engine's thread: ``os.urandom`` there would
        release the GIL and hand the thread's time to whoever waits for it."""
        if len(self._tokens) < _TOKENS_LOW:
            raw = os.urandom(16 * _TOKENS_BATCH)
            self._tokens.extend(raw[i : i + 16] for i in range(0, len(raw), 16))

    def expect(
        self, rid: str, span: KVSpan, timeout: float | None, prepared: Prepared | None = None
    ) -> Expectation:
        self._refill()
        sink = KVSink(self.cache, span)
        token = prepared.token if prepared is not None else None
        h = self.receiver.expect(rid, sink, timeout=timeout, token=token)
        stats = DeliveryStats(rid, self.identity, "tcp", bytes=sink.nbytes)

        def finish(_n: Any, st: DeliveryStats) -> None:
            st.wire_bytes = h.stats.wire_bytes  # the chunk bodies that arrived

        ticket = prepared.ticket if prepared is not None else self._ticket(rid, span, token=h.token)
        return self._expectation(stats, h.wait(), lambda: h.progress, h.cancel, finish, ticket)


# ---- UCX -----------------------------------------------------------------------------
class UcxInbound(Inbound):
    """The bridge's UCX agent (the cache registered once for one-sided puts),
    and, with ``control=(host, port)``, the TCP endpoint that serves its
    metadata, so that a prefill connected by that address reconnects by
    itself after this process restarts.  ``description`` is the bridge's
    (:func:`~kvbridge.bridge.identity.describe`), wrapped around the agent's
    registration blob in :meth:`metadata`."""

    transport = TicketTransport.UCX

    def __init__(
        self,
        cache: Any,
        identity: str,
        model_id: str,
        *,
        description: Any,
        options: dict[str, Any],
        control: tuple[str, int] | None = None,
    ) -> None:
        super().__init__(cache, identity, model_id)
        self.description = description
        self._options = options
        self._control_at = control
        self._control: asyncio.Server | None = None
        self._agent: Any = None

    async def start(self) -> None:
        from ..transport import ucx as _ucx

        if not _ucx.available():
            raise Unavailable(f"UCX transport requested: {_ucx.unavailable_reason()}")
        self._agent = _ucx.UcxAgent(self.layout, self.cache, **self._options)
        self._agent.start()
        if self._control_at is not None:
            from ..transport.ucx.control import serve_metadata

            host, port = self._control_at
            self._control = await serve_metadata(self._agent, host, port, blob=self.metadata())

    async def close(self) -> None:
        if self._control is not None:
            self._control.close()
            await self._control.wait_closed()
            self._control = None
        if self._agent is not None:
            await self._agent.close()

    @property
    def agent(self) -> Any:
        if self._agent is None:
            raise Unavailable("this decode bridge's UCX agent is not started (start() first)")
        return self._agent

    @property
    def endpoint(self) -> tuple[str, int] | None:
        """Where the metadata is served (``control``); None without it."""
        if self._control is None:
            return None
        host, port = self._control.sockets[0].getsockname()[:2]
        return (str(host), int(port))

    def metadata(self) -> bytes:
        """The opaque, versioned bytes a prefill passes to connect: the
        bridge's description around the agent's registration blob
        (docs/protocol.md 8.4)."""
        return wrap_ucx_metadata(self.description, bytes(self.agent.metadata()))

    def prepare(self, rid: str, span: KVSpan) -> Prepared:
        span.check_pages(self.cache)
        return Prepared(span, self._ucx_ticket(rid, span))

    def _ucx_ticket(self, rid: str, span: KVSpan) -> bytes:
        return self._ticket(
            rid, span, agent_id=self.agent.agent_id, block_table=tuple(span.block_table.tolist())
        )

    def expect(
        self, rid: str, span: KVSpan, timeout: float | None, prepared: Prepared | None = None
    ) -> Expectation:
        agent = self.agent
        uh = agent.expect(rid, span, timeout=timeout)
        stats = DeliveryStats(rid, self.identity, "ucx", bytes=0)

        def finish(res: Any, st: DeliveryStats) -> None:
            st.bytes = int(getattr(res, "bytes", 0))
            st.wire_bytes = st.bytes
            st.path = "ucx-" + str(getattr(res, "path", "") or "put")

        ticket = prepared.ticket if prepared is not None else self._ucx_ticket(rid, span)
        return self._expectation(
            stats, uh.wait(), lambda: 1.0 if uh.done() else 0.0, uh.cancel, finish, ticket
        )
