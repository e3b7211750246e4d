"""The decode side of the bridge (relay decode and main decode)."""

from __future__ import annotations

import asyncio
import operator
import ssl as _ssl
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidArgument, LayoutError, OverlapError, Unavailable
from ..layout import tp_head_range
from ..pack import PagedKVCache
from ..span import KVSpan, as_span
from ..transport.tcp import ReceiverLimits, TcpReceiver
from ..transport.tcp.kvio import KVSink
from .handles import Delivery, DeliveryStats
from .identity import describe, wrap_ucx_metadata
from .metrics import BridgeMetrics, BridgeMetricsView
from .prefill import _view
from .ticket import Ticket, TicketTransport

__all__ = ["DecodeBridge", "Expectation", "plan_sources", "tp_sources"]


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


class DecodeBridge:
    """What a relay decode or main decode embeds.

    ``tcp_listen=(host, port)`` accepts WAN (or local) TCP senders;
    ``ucx=True`` registers the cache once for one-sided UCX puts;
    ``ucx_control=(host, port)`` also serves :meth:`ucx_metadata` there, so
    that a prefill connected by that address reconnects by itself after this
    process restarts (new metadata, same address).  A transport
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
        ucx_control: tuple[str, int] | None = None,
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
        # UCX peers prove the same key as TCP's; without one, the bridge takes
        # unauthenticated peers on both transports alike
        self._ucx_options = {
            "identity": identity,
            "psk": psk,
            "allow_unauthenticated": psk is None,
            **(ucx_options or {}),
        }
        self._ucx: Any = None
        # UCX: a TCP endpoint that serves ucx_metadata() to prefills, which
        # fetch it again to reconnect after this process restarts
        self._ucx_control_at = ucx_control
        self._ucx_control: asyncio.Server | None = None

    async def start(self) -> DecodeBridge:
        if self._tcp is not None:
            await self._tcp.start()
        if self._want_ucx:
            from ..transport import ucx as _ucx

            if not _ucx.available():
                raise Unavailable(f"UCX transport requested: {_ucx.unavailable_reason()}")
            self._ucx = _ucx.UcxAgent(self.layout, self.cache, **self._ucx_options)
            self._ucx.start()
            if self._ucx_control_at is not None:
                from ..transport.ucx.control import serve_metadata

                host, port = self._ucx_control_at
                self._ucx_control = await serve_metadata(
                    self._ucx, host, port, blob=self.ucx_metadata()
                )
        return self

    async def close(self) -> None:
        if self._ucx_control is not None:
            self._ucx_control.close()
            await self._ucx_control.wait_closed()
            self._ucx_control = None
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

    @property
    def ucx_control_address(self) -> tuple[str, int]:
        """Where this bridge serves its UCX metadata (``ucx_control``): a
        prefill's ``PeerConfig("ucx", host, port)``."""
        if self._ucx_control is None:
            raise Unavailable("this decode bridge serves no UCX metadata (ucx_control=None)")
        host, port = self._ucx_control.sockets[0].getsockname()[:2]
        return (str(host), int(port))

    def ucx_metadata(self) -> bytes:
        """The opaque, versioned bytes a prefill passes to connect: the
        bridge's description around its UCX agent's registration blob
        (docs/protocol.md 8.4)."""
        return wrap_ucx_metadata(self.description, bytes(self._require_ucx().metadata()))

    @property
    def tcp_receiver(self) -> TcpReceiver | None:
        """The TCP receiver (``tcp_listen``), for CONTROL messages; None
        without one."""
        return self._tcp

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
        start: int | None = None,
        end: int | None = None,
        *,
        layers: tuple[int, int] | None = None,
        via: str = "tcp",
        timeout: float | None = 60.0,
        heads: tuple[int, int] | None = None,
        sources: Sequence[tuple[str, tuple[int, int]]] | None = None,
    ) -> Expectation:
        """Expect tokens ``[start, end)`` (and ``layers``) of a request into the
        pages ``block_table``.  Give ``expectation.ticket`` to the sender.  A
        :class:`~kvbridge.span.KVSpan` may stand for ``block_table``,
        ``start``, ``end``, ``layers`` and ``heads``: ``expect(rid, span)``.

        ``heads`` is the range of the model's KV heads wanted (default all
        this cache holds).  ``sources`` names the sender ranks and the heads
        each holds, ``[(name, (h0, h1)), ...]`` (e.g. :func:`tp_sources`):
        then ``expectation.tickets`` holds one ticket per sender whose heads
        meet the wanted ones (that intersection), the expectation completes
        once every part landed, and the first part to fail fails it, with
        its error, and cancels the others.  Sources whose intersections
        overlap raise :class:`~kvbridge.errors.OverlapError`, wanted heads
        that no source holds :class:`~kvbridge.errors.LayoutError`."""
        rid = str(request_id)
        span = as_span(block_table, start, end, layers, heads, what="expect()")
        span = span.resolve(self.layout)  # LayoutError outside our layers or heads
        assert span.heads is not None
        if via not in ("tcp", "ucx"):
            raise InvalidArgument(f"unknown transport {via!r} (use 'tcp' or 'ucx')")
        if sources is None:
            exp = self._expect_part(rid, span, via, timeout)
        else:
            plan = plan_sources(span.heads, sources)
            parts: dict[str, Expectation] = {}
            try:
                for name, part_heads in plan:
                    parts[name] = self._expect_part(
                        rid, span.replace(heads=part_heads), via, timeout
                    )
            except BaseException:
                for p in parts.values():
                    p.cancel("the expectation failed to start")
                raise
            exp = _joined(rid, self.identity, via, parts)
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

    def _expect_part(self, rid: str, span: KVSpan, via: str, timeout: float | None) -> Expectation:
        """One expected transfer of ``span`` (resolved: its heads are this
        part's; its own token on TCP, its own UCX expectation), with its
        ticket."""
        assert span.layers is not None and span.heads is not None
        l0, l1 = span.layers
        heads = span.heads
        start, end = span.start, span.end
        # the ticket names the heads unless they are all the model's (version 1 bytes)
        named = None if heads == (0, self.layout.total_kv_heads) else heads
        if via == "tcp":
            tcp = self.tcp
            sink = KVSink(self.cache, span)
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
                heads=named,
            )
            stats = DeliveryStats(rid, self.identity, "tcp", bytes=sink.nbytes)

            def finish_tcp(_n: Any, st: DeliveryStats) -> None:
                st.wire_bytes = h.stats.wire_bytes  # the chunk bodies that arrived

            exp = Expectation(stats, h.wait(), lambda: h.progress, h.cancel, finish_tcp)
        else:
            agent = self._require_ucx()
            uh = agent.expect(rid, span, timeout=timeout)
            ticket = Ticket(
                TicketTransport.UCX,
                rid,
                start,
                end,
                l0,
                l1,
                self.layout.compat_hash,
                agent_id=agent.agent_id,
                block_table=tuple(span.block_table.tolist()),
                model=self.model_id,
                heads=named,
            )
            stats = DeliveryStats(rid, self.identity, "ucx", bytes=0)

            def finish_ucx(res: Any, st: DeliveryStats) -> None:
                st.bytes = int(getattr(res, "bytes", 0))
                st.wire_bytes = st.bytes
                st.path = "ucx-" + str(getattr(res, "path", "") or "put")

            exp = Expectation(
                stats, uh.wait(), lambda: 1.0 if uh.done() else 0.0, uh.cancel, finish_ucx
            )
        exp.set_tickets({"": ticket.encode()})
        return exp


def plan_sources(
    want: tuple[int, int], sources: Sequence[tuple[str, tuple[int, int]]]
) -> list[tuple[str, tuple[int, int]]]:
    """``[(name, heads), ...]``: each source's intersection with the wanted
    heads ``want``, for the sources that hold some of them; the intersections
    must not overlap (:class:`~kvbridge.errors.OverlapError`) and must cover
    ``want`` (:class:`~kvbridge.errors.LayoutError`)."""
    w0, w1 = want
    out: list[tuple[str, tuple[int, int]]] = []
    names: set[str] = set()
    for item in sources:
        try:
            name, (a, b) = item
            a, b = operator.index(a), operator.index(b)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"a source is (name, (h0, h1)), the heads a sender holds; got {item!r}"
            ) from None
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"a source's name must be a non-empty str, got {name!r}")
        if name in names:
            raise InvalidArgument(f"source {name!r} is named twice")
        names.add(name)
        if not 0 <= a < b:
            raise LayoutError(f"source {name!r} holds an empty or negative head range [{a}, {b})")
        lo, hi = max(a, w0), min(b, w1)
        if lo < hi:
            out.append((name, (lo, hi)))
    out.sort(key=lambda p: p[1])
    at, prev = w0, ""
    for name, (lo, hi) in out:
        if lo < at:
            raise OverlapError(
                f"sources {prev!r} and {name!r} both hold heads [{lo}, {min(hi, at)}) "
                f"of the wanted [{w0}, {w1}): give each head one source"
            )
        if lo > at:
            raise LayoutError(f"no source holds heads [{at}, {lo}) of the wanted [{w0}, {w1})")
        at, prev = hi, name
    if at < w1:
        raise LayoutError(f"no source holds heads [{at}, {w1}) of the wanted [{w0}, {w1})")
    return out


def tp_sources(names: Sequence[str], kv_heads: int) -> list[tuple[str, tuple[int, int]]]:
    """The sources of a tensor-parallel group of ``len(names)`` ranks (rank
    ``i`` is ``names[i]``) over a model of ``kv_heads`` KV heads, split as
    :func:`kvbridge.layout.tp_head_range` does.  Where ranks replicate a head
    (more ranks than heads) the first rank holding it is its source."""
    out: list[tuple[str, tuple[int, int]]] = []
    taken: set[tuple[int, int]] = set()
    for rank, name in enumerate(names):
        first, n = tp_head_range(kv_heads, len(names), rank)
        rng = (first, first + n)
        if rng not in taken:
            taken.add(rng)
            out.append((str(name), rng))
    return out


def _joined(rid: str, identity: str, via: str, parts: dict[str, Expectation]) -> Expectation:
    """One expectation over several parts: done once all are, failed (once,
    with the first part's error) as soon as one fails, which cancels the rest."""
    stats = DeliveryStats(rid, identity, via)
    waits = {name: asyncio.ensure_future(_outcome(p)) for name, p in parts.items()}
    for w in waits.values():  # the parts after the first failure are not awaited
        w.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def all_parts() -> list[DeliveryStats]:
        pending = set(waits.values())
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    exc = f.exception()
                    if exc is not None:
                        failed = next(n for n, w in waits.items() if w is f)
                        for name, p in parts.items():
                            if name != failed:
                                p.cancel(f"part {failed!r} of request {rid!r} failed: {exc}")
                        raise exc
        finally:
            for f in pending:
                f.cancel()
        return [w.result() for w in waits.values()]

    def progress() -> float:
        return sum(p.progress for p in parts.values()) / max(1, len(parts))

    def cancel(reason: str) -> None:
        for p in parts.values():
            p.cancel(reason)

    def finish(results: list[DeliveryStats], st: DeliveryStats) -> None:
        st.bytes = sum(r.bytes for r in results)
        st.wire_bytes = sum(r.wire_bytes for r in results)
        st.path = results[0].path if results else via

    exp = Expectation(stats, all_parts(), progress, cancel, finish)
    exp.parts = dict(parts)
    exp.set_tickets({name: p.ticket for name, p in parts.items()})
    return exp


async def _outcome(d: Delivery) -> DeliveryStats:
    return await d
