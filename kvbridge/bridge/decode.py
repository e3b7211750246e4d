"""The decode side of the bridge (relay decode and main decode)."""

from __future__ import annotations

import asyncio
import operator
import ssl as _ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument, LayoutError, OverlapError, Unavailable
from ..layout import tp_head_range
from ..pack import PagedKVCache
from ..span import as_span
from ..transport.tcp import ReceiverLimits, TcpReceiver
from .handles import Delivery, DeliveryStats
from .identity import describe
from .inbound import Expectation, Inbound, Prepared, TcpInbound, UcxInbound
from .metrics import BridgeMetrics, BridgeMetricsView
from .prefill import _view

__all__ = ["DecodeBridge", "Expectation", "PreparedExpect", "plan_sources", "tp_sources"]


@dataclass(frozen=True)
class PreparedExpect:
    """An expectation checked and ticketed, not registered yet
    (:meth:`DecodeBridge.prepare_expect`): one :class:`Prepared` part per
    source (one, named "", without ``sources``)."""

    request_id: str
    via: str
    parts: dict[str, Prepared]
    joined: bool

    @property
    def ticket(self) -> bytes:
        (p,) = self.parts.values()
        return p.ticket

    @property
    def tickets(self) -> dict[str, bytes]:
        return {name: p.ticket for name, p in self.parts.items()}


class DecodeBridge:
    """What a relay decode or main decode embeds.

    ``tcp_listen=(host, port)`` accepts WAN (or local) TCP senders;
    ``ucx=True`` registers the cache once for one-sided UCX puts;
    ``ucx_control=(host, port)`` also serves :meth:`ucx_metadata` there, so
    that a prefill connected by that address reconnects by itself after this
    process restarts (new metadata, same address).  A transport
    that was not configured, or is not available here, raises
    :class:`~kvbridge.errors.Unavailable` when asked for; there is no silent
    fallback.  Each configured transport is one
    :class:`~kvbridge.bridge.inbound.Inbound` (``inbounds``, by its name);
    the bridge expects transfers only through them.

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
        self.inbounds: dict[str, Inbound] = {}
        if tcp_listen is not None:
            self.inbounds["tcp"] = TcpInbound(
                cache,
                identity,
                model_id,
                tcp_listen,
                description=self.description,
                psk=psk,
                ssl=ssl,
                allowed_identities=allowed_identities,
                tls_identity=tls_identity,
                limits=limits,
                keepalive_interval=keepalive_interval,
                keepalive_timeout=keepalive_timeout,
            )
        if ucx:
            # UCX peers prove the same key as TCP's; without one, the bridge
            # takes unauthenticated peers on both transports alike
            options = {
                "identity": identity,
                "psk": psk,
                "allow_unauthenticated": psk is None,
                **(ucx_options or {}),
            }
            self.inbounds["ucx"] = UcxInbound(
                cache,
                identity,
                model_id,
                description=self.description,
                options=options,
                control=ucx_control,
            )

    async def start(self) -> DecodeBridge:
        for inbound in self.inbounds.values():
            await inbound.start()
        return self

    async def close(self) -> None:
        for inbound in self.inbounds.values():
            await inbound.close()

    async def __aenter__(self) -> DecodeBridge:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def inbound(self, via: str) -> Inbound:
        """The receiving transport ``via`` ("tcp" or "ucx"):
        :class:`~kvbridge.errors.Unavailable` when it was not configured."""
        got = self.inbounds.get(via)
        if got is not None:
            return got
        if via == "tcp":
            raise Unavailable("this decode bridge has no TCP listener (tcp_listen=None)")
        if via == "ucx":
            raise Unavailable("this decode bridge was not started with ucx=True")
        raise InvalidArgument(f"unknown transport {via!r} (use 'tcp' or 'ucx')")

    # ---- addresses ---------------------------------------------------------------
    @property
    def tcp_address(self) -> tuple[str, int]:
        return self._tcp().endpoint

    @property
    def ucx_control_address(self) -> tuple[str, int]:
        """Where this bridge serves its UCX metadata (``ucx_control``): a
        prefill's ``PeerConfig("ucx", host, port)``."""
        at = self._ucx().endpoint if "ucx" in self.inbounds else None
        if at is None:
            raise Unavailable("this decode bridge serves no UCX metadata (ucx_control=None)")
        return at

    def ucx_metadata(self) -> bytes:
        """The opaque, versioned bytes a prefill passes to connect: the
        bridge's description around its UCX agent's registration blob
        (docs/protocol.md 8.4)."""
        return self._ucx().metadata()

    @property
    def tcp_receiver(self) -> TcpReceiver | None:
        """The TCP receiver (``tcp_listen``), for CONTROL messages; None
        without one."""
        tcp = self.inbounds.get("tcp")
        return tcp.receiver if isinstance(tcp, TcpInbound) else None

    @property
    def ucx_agent(self) -> Any:
        """The UCX agent (ucx=True), to share with a PrefillBridge on this cache."""
        return self._ucx().agent

    @property
    def tcp(self) -> TcpReceiver:
        return self._tcp().receiver

    def _tcp(self) -> TcpInbound:
        got = self.inbound("tcp")
        assert isinstance(got, TcpInbound)
        return got

    def _ucx(self) -> UcxInbound:
        got = self.inbound("ucx")
        assert isinstance(got, UcxInbound)
        return got

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
        prep = self.prepare_expect(
            request_id, block_table, start, end,
            layers=layers, via=via, heads=heads, sources=sources,
        )  # fmt: skip
        return self.expect_prepared(prep, timeout)

    def prepare_expect(
        self,
        request_id: str | int,
        block_table: Any,
        start: int | None = None,
        end: int | None = None,
        *,
        layers: tuple[int, int] | None = None,
        via: str = "tcp",
        heads: tuple[int, int] | None = None,
        sources: Sequence[tuple[str, tuple[int, int]]] | None = None,
    ) -> PreparedExpect:
        """Everything of :meth:`expect` but the registration: the arguments
        checked (the same typed errors), the tickets made.  It reads only
        what does not change while the bridge runs, so any thread may call
        it; :meth:`expect_prepared` registers the result on the loop."""
        rid = str(request_id)
        span = as_span(block_table, start, end, layers, heads, what="expect()")
        span = span.resolve(self.layout)  # LayoutError outside our layers or heads
        assert span.heads is not None
        if via not in ("tcp", "ucx"):
            raise InvalidArgument(f"unknown transport {via!r} (use 'tcp' or 'ucx')")
        inbound = self.inbound(via)
        if sources is None:
            return PreparedExpect(rid, via, {"": inbound.prepare(rid, span)}, joined=False)
        plan = plan_sources(span.heads, sources)
        parts = {name: inbound.prepare(rid, span.replace(heads=h)) for name, h in plan}
        return PreparedExpect(rid, via, parts, joined=True)

    def expect_prepared(self, prep: PreparedExpect, timeout: float | None = 60.0) -> Expectation:
        """Register what :meth:`prepare_expect` made (on the loop); the
        expectation's tickets are the prepared ones."""
        rid = prep.request_id
        inbound = self.inbound(prep.via)
        if not prep.joined:
            (p,) = prep.parts.values()
            exp = inbound.expect(rid, p.span, timeout, p)
        else:
            parts: dict[str, Expectation] = {}
            try:
                for name, p in prep.parts.items():
                    parts[name] = inbound.expect(rid, p.span, timeout, p)
            except BaseException:
                for e in parts.values():
                    e.cancel("the expectation failed to start")
                raise
            exp = _joined(rid, self.identity, prep.via, parts)
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
