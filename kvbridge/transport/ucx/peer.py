"""A connected remote agent, and the sending side of a transfer: the put
path (same memory layout: coalesced one-sided puts, then the DONE
notification) or the staging path (pack, put, unpack)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import Cancelled, KVBridgeError, LayoutError, PageIndexError, code_for_error
from ...layout import KVLayout
from ...span import as_span
from .handle import TransferHandle
from .messages import Kind, Message
from .metadata import AgentMetadata, RegionKind
from .runs import CacheGeometry, as_table

if TYPE_CHECKING:
    from .agent import UcxAgent

__all__ = ["PreparedSend", "UcxPeer"]

# the handle of a put that completed inline (called once per small send)
_completed_send = TransferHandle.completed_send


MAX_ABORTED = 4096  # requests a peer aborted that a peer remembers, to refuse their sends


class UcxPeer:
    """A connected remote agent.  Create with :meth:`UcxAgent.connect`."""

    def __init__(self, host: UcxAgent, md: AgentMetadata, ep: int, same_layout: bool) -> None:
        self._host = host
        self._metadata = md
        self._ep = ep
        self.same_layout = same_layout
        self.name = md.agent_id.hex()
        self.error: KVBridgeError | None = None
        self._last_heard = time.monotonic()
        self._geometry = CacheGeometry(md.layout, md.num_pages)
        regions = list(md.regions)
        self._cache_region_ids = np.array(
            [i for i, r in enumerate(regions) if r.kind is RegionKind.CACHE], dtype=np.int64
        )
        self._staging_index = md.staging_region()
        self._sends: dict[int, TransferHandle] = {}
        self._plan: Any = None  # the engine's RunPlan to this peer (same layout only)
        self._rx_tag = b""  # the tag we issued to it: the sender of its messages to us
        self._tx_tag = b""  # the tag it issued to us (HELLO exchange): empty until then
        self.identity = ""  # the identity it named in the HELLO exchange
        self.authenticated = False  # its proof verified against our pre-shared key
        self._early_parts = 0  # its parts kept until their expect
        # requests it aborted (its expectation failed or was cancelled): a later
        # send of one would write into pages the receiver may have freed
        self._aborted: dict[str, KVBridgeError] = {}

    @property
    def layout(self) -> KVLayout:
        return self._metadata.layout

    @property
    def agent_id(self) -> bytes:
        return self._metadata.agent_id

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        self._host._check_open()

    # ---- the user's API --------------------------------------------------------------
    def send(
        self,
        request_id: str,
        block_table: Any,
        remote_block_table: Any,
        start: int | None = None,
        end: int | None = None,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
        path: str | None = None,
        heads: tuple[int, int] | None = None,
    ) -> TransferHandle:
        """Send tokens ``[start, end)`` of layers ``layers`` (all when None) from
        our pages ``block_table`` into the peer's pages ``remote_block_table``
        (or a :class:`~kvbridge.span.KVSpan` of ours in place of
        ``block_table``, ``start``, ``end``, ``layers`` and ``heads``:
        ``send(rid, span, remote_block_table)``).
        ``heads``: the model's KV heads ``[h0, h1)`` to send (default all our
        cache holds; the receiver expects exactly these).  ``path`` forces
        "put" or "staging"; by default the put path is taken when both
        layouts are the same, all our heads go, and the runs are not tiny;
        a head sub-range always goes through the staging path."""
        if self.error is not None:
            raise self.error
        host = self._host
        host._check_open()
        span = as_span(block_table, start, end, layers, heads, what="UcxPeer.send()")
        lay = host.layout
        rid = request_id if type(request_id) is str else str(request_id)
        if rid in self._aborted:
            raise self._aborted[rid]
        whole = span.heads is None
        span = span.resolve(lay)  # LayoutError outside our layers or heads
        assert span.layers is not None and span.heads is not None
        l0, l1 = span.layers
        whole = whole or span.heads == lay.head_range
        deadline = timeout or host._timeout
        if path == "put" and not whole:
            raise LayoutError("the put path sends whole pages: a head sub-range goes staged")
        if self.same_layout and path != "staging" and whole:
            min_run = 0
            if path != "put" and host._min_put_run_bytes and self._staging_index is not None:
                staging = host._staging
                if staging.usable and staging.pack_module() is not None:
                    min_run = host._min_put_run_bytes
            posted = host._put_range(self, span, remote_block_table, rid, min_run)
            if posted is not None:  # else the runs are tiny: staged instead
                op, status, nruns, nbytes = posted
                if status == 0:  # flushed at the target and its DONE sent, inline
                    return _completed_send(rid, nbytes, nruns, deadline, host._abort)
                return self._put_in_flight(rid, op, status, nruns, nbytes, deadline)
        elif path == "put":
            raise LayoutError("the put path needs both caches to have the same memory layout")
        staging = host._staging
        staging.require(self)
        h = host._new_handle(
            rid, "send", lay.wire_nbytes(span.num_tokens, (l0, l1), span.heads), deadline
        )
        h.owner = self
        h.stats.path = "staging"
        self._track(h)
        staging.start_send(self, h, span)
        return h

    def expect(
        self,
        request_id: str,
        block_table: Any,
        start: int | None = None,
        end: int | None = None,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
        heads: tuple[int, int] | None = None,
    ) -> TransferHandle:
        """Expect ``request_id`` from this peer (fails with PeerGone if it
        dies); a :class:`~kvbridge.span.KVSpan` may stand for the range."""
        self._check()
        span = as_span(block_table, start, end, layers, heads, what="UcxPeer.expect()")
        return self._host.expect(request_id, span, timeout=timeout, peer=self)

    def abort(self, request_id: str, error: KVBridgeError | None = None) -> None:
        """Abort ``request_id`` at the peer (its expect fails with the error
        that ``error``'s ABORT code maps to: ``TransferAborted`` for a
        ``Cancelled``, the default) and fail our sends of it here, also when
        none is in flight: a layer-wise sender whose remaining layers will
        never come tells the receiver so."""
        self._check()
        rid = str(request_id)
        exc = error if error is not None else Cancelled(f"request {rid!r} aborted by the sender")
        self._fail_sends(exc, rid)  # their puts not posted yet never are
        msg = Message(Kind.ABORT, self._host.agent_id, rid, code=code_for_error(exc), text=str(exc))
        # after a flush: the ABORT arrives after every byte we posted landed
        self._host._post(self, msg, flushed=True)

    async def close(self) -> None:
        """Say goodbye and release the endpoint."""
        await self._host._close_peer(self)

    def prepare_send(
        self,
        block_table: Any,
        remote_block_table: Any,
        start: int | None = None,
        end: int | None = None,
        layers: tuple[int, int] | None = None,
    ) -> PreparedSend:
        """A put-path send of tokens ``[start, end)`` of ``layers`` from our
        pages ``block_table`` into the peer's ``remote_block_table``, checked
        and turned into coalesced runs once, to post as often as needed
        with :meth:`PreparedSend.post` (each post under its own request
        id): what NIXL's prepared transfer handles are to its users.  Both
        caches must have the same memory layout (``LayoutError``
        otherwise); bad pages raise ``PageIndexError`` here, not at a post.
        A :class:`~kvbridge.span.KVSpan` of ours (all heads) may stand for
        ``block_table``, ``start``, ``end`` and ``layers``."""
        self._check()
        host = self._host
        span = as_span(block_table, start, end, layers, None, what="prepare_send()")
        l0, l1 = host.layout.layer_range(span.layers)
        start, end = span.start, span.end
        if not self.same_layout:
            raise LayoutError(
                "a prepared send takes the put path: both caches need the same layout"
            )
        bt, rbt = as_table(span.block_table), as_table(remote_block_table)
        try:
            prepared = host._run_plan(self).prepare(bt, rbt, start, end, l0, l1)
        except IndexError as e:
            raise PageIndexError(str(e)) from None
        except ValueError as e:
            raise LayoutError(str(e)) from None
        return PreparedSend(self, start, end, (l0, l1), prepared)

    # ---- used by the agent ----------------------------------------------------------------
    def _put_in_flight(
        self, rid: str, op: int, status: int, nruns: int, nbytes: int, deadline: float
    ) -> TransferHandle:
        """The handle of put ``op`` that did not complete inline (``status``)."""
        host = self._host
        h = host._new_handle(rid, "send", nbytes, deadline, armed=False)
        h.owner = self
        h.stats.path = "put"
        h.stats.runs = nruns
        h.stats.bytes = nbytes
        host._adopt_put(self, h, op, status)
        return h

    def _track(self, h: TransferHandle) -> None:
        """A send of ours to this peer is in flight."""
        self._sends[id(h)] = h

    def _untrack(self, h: TransferHandle) -> None:
        self._sends.pop(id(h), None)

    def _sends_for(self, rid: str) -> list[TransferHandle]:
        return [h for h in self._sends.values() if h.request_id == rid]

    def _fail_sends(self, exc: KVBridgeError, rid: str | None = None) -> None:
        """Fail our sends to this peer (of ``rid``, or all) and stop their
        tasks; a send of ``rid`` stops its put batch in the engine (its runs
        not posted yet never are, its DONE is not sent)."""
        ops = []
        for h in list(self._sends.values()):
            if rid is not None and h.request_id != rid:
                continue
            if h.op:
                ops.append(h.op)
            h.fail(exc)
            if h.task is not None:
                h.task.cancel()
            self._sends.pop(id(h), None)
        if rid is not None and ops:
            self._host._stop_ops(self, ops)

    def _receiver_aborted(self, rid: str, exc: KVBridgeError) -> None:
        """The peer aborted ``rid``: fail our sends of it, and refuse later
        ones (the last ``MAX_ABORTED`` requests are remembered)."""
        self._fail_sends(exc, rid)
        self._aborted[rid] = exc
        while len(self._aborted) > MAX_ABORTED:
            del self._aborted[next(iter(self._aborted))]

    def _gone(self, exc: KVBridgeError) -> None:
        """The peer is gone (or closed): remember why and fail our sends."""
        if self.error is None:
            self.error = exc
        self._fail_sends(exc)


class PreparedSend:
    """A put-path send of one page range to one peer, made once by
    :meth:`UcxPeer.prepare_send` and posted as often as needed, each post
    under its own request id.  A post is one engine call (the runs' puts,
    their flush, then the DONE naming the request, encoded in C++) and a
    handle, as :meth:`UcxPeer.send` returns: the receiver expects each
    request as usual.  The pages are read when a post runs, so a post after
    they changed sends what they hold then."""

    __slots__ = ("_prepared", "end", "layers", "nbytes", "peer", "runs", "start")

    def __init__(
        self, peer: UcxPeer, start: int, end: int, layers: tuple[int, int], prepared: Any
    ) -> None:
        self.peer = peer
        self.start = start
        self.end = end
        self.layers = layers
        self.runs: int = prepared.runs  # one-sided puts per post (after coalescing)
        self.nbytes: int = prepared.nbytes  # KV bytes per post
        self._prepared = prepared

    def post(self, request_id: str, *, timeout: float | None = None) -> TransferHandle:
        """Send the range as request ``request_id``; the handle completes when
        its DONE is sent (after the flush: the bytes are at the peer)."""
        peer = self.peer
        if peer.error is not None:
            raise peer.error
        host = peer._host
        host._check_open()
        rid = request_id if type(request_id) is str else str(request_id)
        op, status = host._put_prepared(peer, self._prepared, rid)
        deadline = timeout or host._timeout
        if status == 0:  # flushed at the target and its DONE sent, inline
            return _completed_send(rid, self.nbytes, self.runs, deadline, host._abort)
        return peer._put_in_flight(rid, op, status, self.runs, self.nbytes, deadline)
