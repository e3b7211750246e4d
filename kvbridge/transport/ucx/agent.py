"""``UcxAgent``: one engine's UCX endpoint.

``UcxAgent(layout, cache)`` registers the cache (one region per layer tensor,
or one for a stacked cache) and a staging buffer once, at start.  Its
``metadata()`` bytes let a peer ``connect()``; then ``peer.send(...)`` writes a
token range (and layer range) of a request straight into the peer's cache when
both layouts are the same (``exact_hash``), or through the staging buffers when
only the wire layout matches (``compat_hash``).  ``agent.expect(...)``
completes when the bytes have landed.  See docs/ucx.md.

The agent owns the engine, the loop binding, the operations in flight, the
heartbeat and the dispatch of control messages; the peers (peer.py), the
handshake (hello.py), the receiving side (expect.py) and the staging path
(staging.py) call its private engine callbacks (the underscored methods
under "used by the parts").  The public surface is what an engine calls:
docs/ucx.md's API section, held by tests/test_ucx_surface.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..._waits import wait_within
from ...errors import (
    Cancelled,
    InvalidArgument,
    KVBridgeError,
    LayoutError,
    PageIndexError,
    PeerGone,
    TransferTimeout,
    Unavailable,
    VersionMismatch,
    code_for_error,
    error_for_code,
    ucs_error,
)
from ...layout import KVLayout, MemoryOrder
from ...span import KVSpan, as_span
from ..deadlines import Deadlines
from .expect import Expect, Expectations
from .handle import TransferHandle
from .hello import Hellos, new_tag
from .loader import DEFAULT_UCX_CONFIG, load, shm_fifo, unavailable_reason
from .messages import (
    MAX_HELLO_BLOB,
    MAX_IDENTITY,
    MAX_RID,
    Kind,
    Message,
    abort_code_v2,
    decode_message,
    encode_message,
    heads_blob,
    message_heads,
)
from .metadata import AgentMetadata, encode_metadata
from .peer import UcxPeer
from .progress import LoopProgress, Progress, ThreadProgress
from .regions import Registration, map_engine_error
from .runs import CacheGeometry, as_table, check_table, plan_args
from .staging import Staging

#: how many dropped peers an agent remembers (a DONE of theirs drained late)
MAX_GONE_IDS = 256

__all__ = ["COUNTERS", "UcxAgent"]

# What stats() counts: messages dropped, parts refused, HELLOs refused.
COUNTERS = (
    "dropped_unknown_sender",  # a message under a tag we never issued (or revoked)
    "dropped_malformed",  # a message that does not decode (bad magic, lengths, kind)
    "dropped_version",  # a message of another version
    "done_wrong_pages",  # a DONE naming other pages than the expectation's
    "done_wrong_peer",  # a part from another peer than the expectation's
    "early_dropped",  # a part before its expect, over the peer's or the agent's bound
    "hello_refused",  # a HELLO refused (authentication, layout, stale, malformed)
    "abort_unacked",  # a peer told ABORT did not acknowledge within abort_quiesce: closed
)

_INPROGRESS = 1  # UCS_INPROGRESS: a post that did not complete inline
_TINY = 2  # put_range: the runs are too short, nothing was posted
_QUEUED = -2  # poll_take: the expectation is not complete, something else is queued

# An op in flight: the handle it completes, or a callback (status) -> None.
_OpEntry = TransferHandle | Callable[[int], None]


class _EngineLedger:
    """The engine's expectation table as the expectations' ledger.  Only an
    expectation of all the heads the cache holds (``own_heads``) can be
    completed by a put, so only it enters the engine's table (one per
    request id there); a head sub-range arrives staged and is counted here."""

    def __init__(self, engine: Any, own_heads: tuple[int, int]) -> None:
        self._engine = engine
        self._own = own_heads
        self._local: dict[int, np.ndarray] = {}  # token -> landed flag per layer

    def register(self, ex: Expect) -> None:
        if ex.heads != self._own:
            self._local[ex.token] = np.zeros(ex.l1 - ex.l0, dtype=bool)
            return
        sender = ex.peer.agent_id if ex.peer is not None else b""
        self._engine.expect(
            ex.token, ex.request_id.encode(), ex.start, ex.end, ex.l0, ex.l1, sender, ex.pages
        )

    def unregister(self, ex: Expect) -> None:
        if self._local.pop(ex.token, None) is None:
            self._engine.unexpect(ex.token)

    def mark(self, ex: Expect, l0: int, l1: int) -> int:
        flags = self._local.get(ex.token)
        if flags is not None:
            flags[l0 - ex.l0 : l1 - ex.l0] = True
            return int(flags.sum())
        sender = ex.peer.agent_id if ex.peer is not None else b""
        return int(self._engine.mark(ex.token, l0, l1, sender))


class UcxAgent:
    """One engine's UCX endpoint: a worker, its registered cache and staging
    buffer, and its peers.  Use from one asyncio loop."""

    def __init__(
        self,
        layout: KVLayout,
        cache: Any,
        *,
        staging_bytes: int = 64 << 20,
        staging_slots: int = 4,
        staging_threads: int = 1,
        timeout: float = 30.0,
        min_put_run_bytes: int = 2048,
        error_mode: str = "none",
        heartbeat: float = 1.0,
        peer_timeout: float = 10.0,
        progress: str = "thread",
        busy_poll_us: int = 1000,
        put_window: int = 64,
        poll_yield_us: int = 0,
        config: dict[str, str] | None = None,
        packer: Any = None,
        psk: bytes | Mapping[str, bytes] | None = None,
        identity: str = "",
        allow_unauthenticated: bool = False,
        abort_quiesce: float = 3.0,
    ) -> None:
        mod = load()
        if mod is None:
            raise Unavailable(f"UCX transport unavailable: {unavailable_reason()}")
        self.layout = layout
        self._cache = cache
        self._token_bytes = layout.token_bytes_per_layer
        self._timeout = float(timeout)
        self._min_put_run_bytes = int(min_put_run_bytes)
        if error_mode not in ("peer", "none"):
            raise InvalidArgument(f"error_mode must be 'peer' or 'none', not {error_mode!r}")
        self._error_mode = error_mode
        if heartbeat <= 0 or peer_timeout <= heartbeat:
            raise InvalidArgument("need 0 < heartbeat < peer_timeout")
        if not 0 < abort_quiesce <= 3600:
            raise InvalidArgument("abort_quiesce must be in (0, 3600] seconds")
        self._abort_quiesce = float(abort_quiesce)
        if progress not in ("thread", "loop"):
            raise InvalidArgument(f"progress must be 'thread' or 'loop', not {progress!r}")
        if not 0 <= busy_poll_us <= 1_000_000:
            raise InvalidArgument("busy_poll_us must be in [0, 1e6]")
        if not 0 <= put_window <= 1 << 20:
            raise InvalidArgument("put_window must be in [0, 2**20] (0: no limit)")
        self._put_window = int(put_window)
        if not 0 <= poll_yield_us <= 1_000_000:
            raise InvalidArgument("poll_yield_us must be in [0, 1e6]")
        self._poll_yield_us = int(poll_yield_us)
        if psk is not None and not isinstance(psk, (bytes, Mapping)):
            raise InvalidArgument("psk must be bytes or a mapping identity -> bytes")
        if len(identity.encode()) > MAX_IDENTITY:
            raise InvalidArgument(f"identity longer than {MAX_IDENTITY} bytes of UTF-8")
        self._psk = psk
        self._allow_unauthenticated = bool(allow_unauthenticated)
        self._progress_mode = progress
        self._busy_poll_us = int(busy_poll_us)
        self._heartbeat = float(heartbeat)
        self._peer_timeout = float(peer_timeout)
        cfg = {k: v for k, v in DEFAULT_UCX_CONFIG.items() if f"UCX_{k}" not in os.environ}
        cfg.update(config or {})
        # what peers must match (metadata version 3 names it when not UCX's default)
        self._shm_fifo = shm_fifo(cfg)
        self._mod = mod
        try:
            self._engine = mod.Engine(list(cfg.items()))
        except mod.UcsError as e:
            raise Unavailable(f"UCX could not start: {e.args[-1]}") from None
        try:
            self._registration = Registration(self._engine, layout, cache, staging_bytes)
        except BaseException:
            self._engine.close()
            raise
        reg = self._registration
        self._num_pages = reg.num_pages
        self._geometry = CacheGeometry(layout, reg.num_pages)
        self.agent_id = os.urandom(16)
        self.identity = identity or self.agent_id.hex()
        self._epoch = time.time_ns()
        self._engine.set_agent_id(self.agent_id)  # the sender of its DONE messages
        self._engine.set_put_window(self._put_window)
        self._engine.set_yield_us(self._poll_yield_us)
        self._md = AgentMetadata(
            self.agent_id,
            self._epoch,
            layout,
            reg.num_pages,
            self._engine.address(),
            reg.regions,
            self._shm_fifo,
        )
        self._blob = encode_metadata(self._md)
        if len(self._blob) > MAX_HELLO_BLOB:
            self._engine.close()
            raise InvalidArgument(
                f"UCX registration metadata of {len(self._blob)} bytes does not fit in a "
                f"HELLO ({MAX_HELLO_BLOB}): too many regions or too long remote keys"
            )
        self._staging = Staging(
            self,
            layout,
            cache,
            reg.tensors,
            reg.staging,
            reg.staging_id,
            staging_slots,
            staging_threads,
            packer,
        )
        self._expectations = Expectations(
            self._reject,
            self._staging.start_recv,
            _EngineLedger(self._engine, layout.head_range),
            layout.head_range,
            self._count,
        )
        self._next_token = 1
        self._in_events = False
        self._hellos = Hellos(self)
        self._peers: dict[bytes, UcxPeer] = {}
        self._by_ep: dict[int, UcxPeer] = {}
        self._by_tag: dict[bytes, UcxPeer] = {}  # the tags we issued -> their peers
        self._counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._ops: dict[int, _OpEntry] = {}
        # ABORTs we sent that their peer has not acknowledged yet: (peer, rid)
        # -> the timer that closes the peer's endpoint at abort_quiesce; the
        # count of such peers per request; what waits for each (a staging slot)
        self._unacked: dict[tuple[UcxPeer, str], asyncio.TimerHandle] = {}
        self._unacked_rids: dict[str, int] = {}
        # the peers dropped last (agent id -> why), newest last
        self._gone_ids: dict[bytes, KVBridgeError] = {}
        self._after_ack: dict[tuple[UcxPeer, str], list[Callable[[], None]]] = {}
        # receives whose outcome is decided and held until their request is quiet
        self._held: set[TransferHandle] = set()
        self._check_soon = False
        self._progress: Progress | None = None
        self._hb_timer: asyncio.TimerHandle | None = None
        self._deadlines = Deadlines()  # of every handle of this agent, on one timer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.on_peer: Any = None  # optional callback(UcxPeer) for accepted peers
        with contextlib.suppress(RuntimeError):  # created inside a running loop: serve now
            self._loop_now()

    # ---- the user's API ---------------------------------------------------------------
    def start(self) -> None:
        """Bind to the running asyncio loop and start answering peers (done
        automatically when the agent is created inside a running loop)."""
        self._loop_now()

    def metadata(self) -> bytes:
        """This agent's registration metadata (opaque, versioned bytes)."""
        return self._blob

    @property
    def peers(self) -> list[UcxPeer]:
        return list(self._peers.values())

    def peer(self, agent_id: bytes | str) -> UcxPeer:
        key = bytes.fromhex(agent_id) if isinstance(agent_id, str) else agent_id
        try:
            return self._peers[key]
        except KeyError:
            raise InvalidArgument(f"no connected peer {key.hex()}") from None

    async def connect(
        self, remote_metadata: bytes, *, timeout: float | None = None, psk: bytes | None = None
    ) -> UcxPeer:
        """Connect to the agent described by ``remote_metadata``; checks that
        the blob is intact and current (a hello answered by that very agent
        incarnation), that the layouts fit and, with a key (``psk``, else
        the agent's own for its identity), that the peer proves it holds
        it.  Returns the peer."""
        self._loop_now()
        return await self._hellos.connect(remote_metadata, timeout, psk)

    def expect(
        self,
        request_id: str,
        block_table: Any,
        start: int | None = None,
        end: int | None = None,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
        peer: UcxPeer | None = None,
        heads: tuple[int, int] | None = None,
    ) -> TransferHandle:
        """Expect tokens ``[start, end)`` of ``layers`` of ``request_id`` into our
        pages ``block_table`` (or a :class:`~kvbridge.span.KVSpan` in place of
        the five: ``expect(rid, span)``).  The handle completes when every
        layer of the range has landed (it may arrive in several layer-range
        sends).  ``heads``: the model's KV heads ``[h0, h1)`` this
        expectation takes (default all the cache holds); one request may be
        expected once per head range, each from its own sender."""
        if self._loop is None or self._closed:
            self._loop_now()
        lay = self.layout
        rid = request_id if type(request_id) is str else str(request_id)
        span = as_span(block_table, start, end, layers, heads, what="UcxAgent.expect()")
        heads = span.heads
        hr = lay.head_range if heads is None else lay.check_heads(heads)  # LayoutError outside
        key = (rid, hr)
        if key in self._expectations:
            raise InvalidArgument(f"request {rid!r} (heads [{hr[0]}, {hr[1]})) is already expected")
        l0, l1 = lay.layer_range(span.layers)
        start, end = span.start, span.end
        bt = as_table(span.block_table)
        if lay.order is MemoryOrder.STRIDED:  # the cache maps its own block table
            self._cache.range(span.replace(layers=(l0, l1), heads=hr))  # raises PageIndexError
        else:
            check_table(self._geometry, bt, start, end)  # raises PageIndexError
        if heads is None:  # all our heads: one token of one layer is token_bytes
            total = (l1 - l0) * (end - start) * self._token_bytes
        else:
            total = lay.wire_nbytes(end - start, (l0, l1), hr)
        pages = 0
        if hr == lay.head_range and start < end:  # a put may complete it: the pages it names
            try:
                pages = self._mod.pages_digest(bt, start, end, lay.page_tokens)
            except (IndexError, ValueError) as e:
                raise PageIndexError(str(e)) from None
        h = self._new_handle(rid, "recv", total, timeout or self._timeout)
        token = self._next_token
        self._next_token = token + 1
        ex = Expect(h, bt, start, end, l0, l1, peer, token, hr, pages)
        h.owner = ex
        if heads is None or hr == lay.head_range:  # in the engine's table: a put completes it
            h.token = token
        h.poller = self._poll_now
        h.gate = self._gate
        self._expectations.add(ex, key)
        if not h.settled:
            self._kick()  # the data is probably on its way: poll for it a while
        return h

    def _poll_now(self, spin_us: int = 0, token: int = 0) -> None:
        """Progress the worker once (``spin_us`` 0: what ``done()`` of a
        handle in flight does, so a polling caller needs no loop wake-up),
        or until something arrives within ``spin_us`` (at most the agent's
        ``busy_poll_us``: what ``await handle`` does before it waits on the
        loop), and account what arrived.  ``token``: the expectation of the
        receive that polls; when DONEs completed it in the engine, only it
        is resolved here (what else arrived is accounted by the loop's next
        turn, which the engine's notify fd wakes; the sender's liveness is
        kept by its PINGs, not by the DONEs taken here)."""
        if self._closed or self._in_events or self._loop is None:
            return
        spin = min(spin_us, self._busy_poll_us)
        yield_us = self._poll_yield_us if spin else 0
        if token:
            nbytes = self._engine.poll_take(spin, token, yield_us)
            if nbytes >= 0:
                self._expectations.on_landed(token, nbytes, None, 0, True)
            elif nbytes == _QUEUED:
                self._on_events()
            return
        got = self._engine.poll_drain(spin, yield_us)
        if got is not None:
            self._on_events(got)

    async def close(self) -> None:
        """Tell peers goodbye, fail what is in flight with Cancelled, release
        the endpoints, the registered memory and the worker."""
        if self._closed:
            return
        if self._loop is not None:
            for p in self.peers:
                self._post(p, Message(Kind.BYE, self.agent_id))
        closing = Cancelled("the UCX agent closed")
        for p in self.peers:
            p._gone(closing)
        self._peers.clear()
        self._by_ep.clear()
        self._by_tag.clear()
        self._expectations.fail_all(closing)
        self._hellos.fail_all(closing)
        await self._staging.close()
        self._closed = True
        if self._hb_timer is not None:
            self._hb_timer.cancel()
        self._deadlines.close()
        if self._progress is not None:
            self._progress.close()  # stops the progress thread
        for entry in self._ops.values():
            if isinstance(entry, TransferHandle):
                entry.fail(closing)
            else:
                entry(-16)  # UCS_ERR_CANCELED
        self._ops.clear()
        self._engine.close()  # flushes what is posted (the BYEs), then closes
        # nothing can land any more: report what waited for its senders
        for timer in self._unacked.values():
            timer.cancel()
        self._unacked.clear()
        self._unacked_rids.clear()
        after = [fn for fns in self._after_ack.values() for fn in fns]
        self._after_ack.clear()
        for fn in after:
            fn()
        held, self._held = self._held, set()
        for h in held:
            h.release()

    def stats(self) -> dict[str, int]:
        """What this agent dropped or refused, by reason (``COUNTERS``)."""
        return dict(self._counts)

    async def __aenter__(self) -> UcxAgent:
        self._loop_now()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- used by the parts (peer, hello, expect, staging) ---------------------------------
    @property
    def _cache_region_ids(self) -> np.ndarray:
        return self._registration.cache_ids

    def _check_open(self) -> None:
        if self._closed:
            raise Cancelled("the UCX agent is closed")

    def _new_handle(
        self, rid: str, direction: str, total: int, timeout: float, *, armed: bool = True
    ) -> TransferHandle:
        if self._loop is None or self._closed:
            self._loop_now()
        return TransferHandle(
            rid, direction, total, timeout, self._abort, armed=armed, deadlines=self._deadlines
        )

    def _make_peer(self, md: AgentMetadata, same_layout: bool, *, listed: bool = True) -> UcxPeer:
        """An endpoint to ``md``'s address and the tag we issue to it (what
        it writes as the sender of every message to us); ``listed``: a peer
        (else a temporary endpoint, for a HELLO_NACK)."""
        regions = [(r.base, r.length, r.rkey) for r in md.regions]
        try:
            ep = self._engine.connect(md.address, regions, self._error_mode == "peer")
        except Exception as e:
            raise map_engine_error(e, "UCX connect") from None
        peer = UcxPeer(self, md, ep, same_layout)
        peer._rx_tag = new_tag()
        if listed:
            self._peers[md.agent_id] = peer
            self._by_ep[ep] = peer
            self._by_tag[peer._rx_tag] = peer
            self._engine.add_peer(peer._rx_tag, md.agent_id)  # its DONEs may land in C++
        self._kick()
        return peer

    def _bind(self, peer: UcxPeer, tx_tag: bytes, identity: str, authenticated: bool) -> None:
        """The HELLO exchange gave ``peer``'s tag for us: what we write as
        the sender of every message to it."""
        peer._tx_tag = tx_tag
        peer.identity = identity
        peer.authenticated = authenticated
        if not self._closed:
            self._engine.set_ep_tag(peer._ep, tx_tag)

    def _psk_key(self, identity: str) -> bytes | None:
        """The key of a connection whose initiator is ``identity``."""
        psk = self._psk
        if psk is None or isinstance(psk, bytes):
            return psk
        return psk.get(identity)

    def _count(self, what: str) -> None:
        self._counts[what] += 1

    def _forget(self, peer: UcxPeer, force: bool = False) -> None:
        """Drop a peer (from ``peers`` too) and release its endpoint; its
        tag is revoked (a later message under it is dropped).  The ABORTs
        it did not acknowledge are settled: with its endpoint closed its
        puts no longer land (see docs/ucx.md, "Ending a request", for what
        error mode "none" over TCP leaves open).  ``force``: closed without
        a flush of what we posted to it (it stopped answering)."""
        if self._peers.get(peer.agent_id) is peer:
            del self._peers[peer.agent_id]
        # a DONE of it drained after this fails the receive it binds (_events)
        self._gone_ids[peer.agent_id] = peer.error or PeerGone(f"peer {peer.name[:8]} was dropped")
        while len(self._gone_ids) > MAX_GONE_IDS:
            del self._gone_ids[next(iter(self._gone_ids))]
        if self._by_ep.pop(peer._ep, None) is None and peer._ep < 0:
            return  # forgotten already
        if self._by_tag.get(peer._rx_tag) is peer:
            del self._by_tag[peer._rx_tag]
        if peer.error is None:
            peer._gone(PeerGone(f"peer {peer.name[:8]} was dropped"))
        self._expectations.fail_peer(peer, peer.error or PeerGone("peer dropped"))
        if not self._closed:
            self._engine.remove_peer(peer._rx_tag)
            self._engine.disconnect(peer._ep, force)
        peer._ep = -1
        if self._unacked:
            for key in [k for k in self._unacked if k[0] is peer]:
                self._acked(*key)

    async def _close_peer(self, peer: UcxPeer) -> None:
        if peer.error is None and not self._closed:
            done: asyncio.Future[None] = self._loop_now().create_future()

            def sent() -> None:
                if not done.done():
                    done.set_result(None)

            self._post(peer, Message(Kind.BYE, self.agent_id), on_sent=sent)
            with contextlib.suppress(asyncio.TimeoutError, KVBridgeError):
                await asyncio.wait_for(done, 1.0)
        self._peer_gone(peer, Cancelled("peer connection closed locally"))

    def _post(
        self,
        peer: UcxPeer,
        msg: Message,
        on_sent: Callable[[], None] | None = None,
        *,
        flushed: bool = False,
    ) -> None:
        """Send a control message under ``peer``'s tag (a HELLO, HELLO_ACK or
        HELLO_NACK as it is); ``on_sent`` runs once it left (or failed).
        ``flushed``: after a flush of the endpoint (an ABORT of ours or an
        ABORT_ACK: every put posted before it has landed when it arrives)."""
        hello = msg.kind <= Kind.HELLO_NACK
        if peer.error is not None or self._closed or (not hello and not peer._tx_tag):
            if on_sent is not None:
                on_sent()
            return
        try:
            wire = encode_message(msg, None if hello else peer._tx_tag)
            if flushed:
                op, status = self._engine.flush_send(peer._ep, wire)
                if status == _INPROGRESS:
                    self._kick()  # its result is drained and dropped, unless on_sent
            else:
                op, status = self._engine.send(peer._ep, wire, on_sent is not None)
        except Exception as e:
            self._peer_gone(peer, map_engine_error(e, "UCX message"))
            if on_sent is not None:
                on_sent()
            return
        if on_sent is None:
            return
        if status == _INPROGRESS:
            self._ops[op] = lambda _status: on_sent()
            self._kick()
        else:
            on_sent()

    def _put_range(
        self,
        peer: UcxPeer,
        span: KVSpan,
        remote_block_table: Any,
        rid: str,
        min_mean_run: int,
    ) -> tuple[int, int, int, int] | None:
        """Compute the coalesced runs of ``span`` (resolved; in C++) and post
        them into the peer's ``remote_block_table``, their flush and then the
        DONE of ``rid`` (encoded in C++); progress inline for up to
        ``busy_poll_us``.  Returns (op, status, runs, bytes), or None when the
        mean run is shorter than ``min_mean_run`` (nothing posted).  The block
        tables go to the engine as they are when they are 1-D arrays (the
        engine converts another integer dtype), else as flat int64 arrays."""
        assert span.layers is not None
        block_table, start, end = span.block_table, span.start, span.end
        l0, l1 = span.layers
        if peer._plan is None:
            self._run_plan(peer)
        rid_bytes = rid.encode()
        if len(rid_bytes) > MAX_RID:
            raise InvalidArgument(f"request id longer than {MAX_RID} bytes")
        eng, ep, plan, spin = self._engine, peer._ep, peer._plan, self._busy_poll_us
        try:
            try:
                posted = eng.put_range(
                    ep, plan, block_table, remote_block_table, start, end, l0, l1, rid_bytes,
                    min_mean_run, spin,
                )  # fmt: skip
            except TypeError:  # not 1-D arrays (a list, a 2-D table)
                bt, rbt = as_table(block_table), as_table(remote_block_table)
                posted = eng.put_range(
                    ep, plan, bt, rbt, start, end, l0, l1, rid_bytes, min_mean_run, spin
                )
        except IndexError as e:
            raise PageIndexError(str(e)) from None
        except ValueError as e:
            raise LayoutError(str(e)) from None
        except Exception as e:
            raise map_engine_error(e, "UCX put") from None
        return None if posted[1] == _TINY else posted  # (op, status, runs, bytes)

    def _run_plan(self, peer: UcxPeer) -> Any:
        """The engine's RunPlan between our cache and ``peer``'s (same
        layout), made on first use."""
        if peer._plan is None:
            peer._plan = self._mod.RunPlan(
                **plan_args(
                    self._geometry, peer._geometry, self._cache_region_ids, peer._cache_region_ids
                )
            )
        return peer._plan

    def _put_prepared(self, peer: UcxPeer, prepared: Any, rid: str) -> tuple[int, int]:
        """Post a PreparedPut under request id ``rid`` (puts, flush, DONE),
        progressing inline for up to ``busy_poll_us``: (op, status)."""
        rid_bytes = rid.encode()
        if len(rid_bytes) > MAX_RID:
            raise InvalidArgument(f"request id longer than {MAX_RID} bytes")
        try:
            posted: tuple[int, int] = self._engine.put_prepared(
                peer._ep, prepared, rid_bytes, self._busy_poll_us
            )
        except Exception as e:
            raise map_engine_error(e, "UCX put") from None
        return posted

    def _adopt_put(self, peer: UcxPeer, h: TransferHandle, op: int, status: int) -> None:
        """``h`` completes with the put ``op`` (``status``: its outcome, or
        UCS_INPROGRESS while in flight)."""
        if status == 0:
            h.finish()
        elif status == _INPROGRESS:
            self._ops[op] = h
            h.op = op
            h.arm()
            h.poller = self._poll_now
            peer._track(h)
            self._kick()
        else:
            h.fail(peer.error or ucs_error(status, f"send {h.request_id!r}"))

    async def _put_and_wait(
        self,
        peer: UcxPeer,
        runs: np.ndarray,
        notify: bytes,
        timeout: float,
        h: TransferHandle | None = None,
    ) -> None:
        """Post a put batch and wait (at most ``timeout``) until it completed
        (``h``: the send it is part of; an ABORT of it stops the batch)."""
        try:
            op, status = self._engine.put(
                peer._ep, np.ascontiguousarray(runs, dtype=np.uint64), notify, self._busy_poll_us
            )
        except Exception as e:
            raise map_engine_error(e, "UCX put") from e
        if status == 0:
            return
        if status != _INPROGRESS:
            raise ucs_error(status, "UCX put")
        fut: asyncio.Future[None] = self._loop_now().create_future()

        def done(st: int) -> None:
            if fut.done():
                return
            if st == 0:
                fut.set_result(None)
            else:
                fut.set_exception(ucs_error(st, "UCX put"))

        self._ops[op] = done
        self._kick()

        def expired() -> TransferTimeout:
            self._ops.pop(op, None)
            self._stop_ops(peer, [op])
            return TransferTimeout(f"UCX put not complete within {timeout} s")

        if h is not None:
            h.op = op
        try:
            await wait_within(fut, timeout, expired)
        finally:
            if h is not None:
                h.op = 0

    def _landed(self, ex: Expect, l0: int, l1: int) -> None:
        self._expectations.landed(ex, l0, l1)

    def _abort(self, h: TransferHandle, exc: KVBridgeError) -> None:
        """A handle failed or was cancelled here: tell the peer (ABORT with the
        ErrorCode of ``exc``) and stop the handle's task.

        A send stops posting its puts and flushes the endpoint before the
        ABORT, so the ABORT arrives after every byte it posted landed.  A
        receive tells the sender it is bound to, or every connected peer
        while it is bound to none (any of them may have a put of it on the
        way), and its outcome is held (``_gate``) until each acknowledged
        (ABORT_ACK) or had its endpoint closed (``abort_quiesce``)."""
        if h.task is not None:
            h.task.cancel()
        owner = h.owner
        rid = h.request_id
        if isinstance(owner, Expect):
            self._expectations.drop(owner)
            msg = Message(
                Kind.ABORT,
                self.agent_id,
                rid,
                code=code_for_error(exc),
                text=str(exc),
                blob=heads_blob(owner.heads, self.layout.total_kv_heads),
            )
            if owner.peer is not None:
                self._send_abort(owner.peer, rid, msg)
            else:
                for p in list(self._peers.values()):
                    self._send_abort(p, rid, msg)
        elif isinstance(owner, UcxPeer):
            owner._untrack(h)
            if h.op:
                self._stop_ops(owner, [h.op])
            msg = Message(Kind.ABORT, self.agent_id, rid, code=code_for_error(exc), text=str(exc))
            self._post(owner, msg, flushed=True)

    # ---- ending a request: no write of it lands after its receive ended ---------------------
    def _stop_ops(self, peer: UcxPeer, ops: list[int]) -> None:
        """Stop our put batches ``ops`` to ``peer``: runs not posted yet never
        are, and their DONEs are not sent."""
        if ops and not self._closed and peer._ep >= 0:
            self._engine.cancel_ops(peer._ep, ops)

    def _send_abort(self, peer: UcxPeer, rid: str, msg: Message) -> None:
        """ABORT ``rid`` at ``peer`` (a sender of it, or maybe one) and wait
        for its ABORT_ACK: until then, or until its endpoint is closed
        (``abort_quiesce`` at most), receives of ``rid`` are held."""
        if peer.error is not None or self._closed or not peer._tx_tag or peer._ep < 0:
            return
        self._post(peer, msg)
        key = (peer, rid)
        if key in self._unacked or peer.error is not None:
            return
        assert self._loop is not None
        self._unacked[key] = self._loop.call_later(
            self._abort_quiesce, self._ack_overdue, peer, rid
        )
        self._unacked_rids[rid] = self._unacked_rids.get(rid, 0) + 1

    def _acked(self, peer: UcxPeer, rid: str) -> None:
        """``peer`` can write nothing of ``rid`` any more (its ABORT_ACK came,
        or its endpoint was closed)."""
        key = (peer, rid)
        timer = self._unacked.pop(key, None)
        if timer is None:
            return
        timer.cancel()
        n = self._unacked_rids.pop(rid, 1) - 1
        if n > 0:
            self._unacked_rids[rid] = n
        for fn in self._after_ack.pop(key, ()):
            fn()
        self._check_held_soon()

    def _after_quiet(self, peer: UcxPeer, rid: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` once ``peer`` can write nothing of ``rid`` any more (now
        when no ABORT of ``rid`` to it is unacknowledged)."""
        key = (peer, rid)
        if key in self._unacked:
            self._after_ack.setdefault(key, []).append(fn)
        else:
            fn()

    def _ack_overdue(self, peer: UcxPeer, rid: str) -> None:
        """``peer`` did not acknowledge an ABORT of ``rid`` within
        ``abort_quiesce``: close its endpoint (forced: a flush would wait for
        it in vain) and drop it, as a dead peer."""
        if (peer, rid) not in self._unacked or self._closed:
            return
        self._counts["abort_unacked"] += 1
        err = PeerGone(
            f"peer {peer.name[:8]} did not acknowledge the ABORT of {rid!r} within "
            f"{self._abort_quiesce} s: its endpoint was closed"
        )
        self._peer_gone(peer, err, force=True)

    def _gate(self, h: TransferHandle) -> bool:
        """A receive's outcome is decided: hold it back (True) while a
        sender's write of its request may still land, i.e. while an ABORT
        of the request is unacknowledged or a staged part of it is being
        unpacked.  A failure is held for at least one loop turn: the ABORTs
        that its ending sends (``_abort``, ``_reject``) are posted right after."""
        if h._exc is None and (not self._unacked_rids or h.request_id not in self._unacked_rids):
            tasks = h.recv_tasks
            if not tasks or all(t.done() for t in tasks):
                return False
        if h.recv_tasks and h._exc is not None:
            for t in h.recv_tasks:
                t.cancel()  # an unpack in progress finishes first (Staging._in_thread)
        if self._closed or self._loop is None:
            return False
        self._held.add(h)
        self._check_held_soon()
        return True

    def _check_held_soon(self) -> None:
        if self._held and not self._check_soon and self._loop is not None and not self._closed:
            self._check_soon = True
            self._loop.call_soon(self._check_held)

    def _check_held(self) -> None:
        """Report the held receives whose request is quiet now."""
        self._check_soon = False
        for h in list(self._held):
            tasks = h.recv_tasks
            if self._closed or (
                h.request_id not in self._unacked_rids
                and (not tasks or all(t.done() for t in tasks))
            ):
                self._held.discard(h)
                h.release()

    # ---- loop binding, progress, heartbeat -------------------------------------------------------
    def _loop_now(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise Cancelled("the UCX agent is closed")
        if self._loop is None:
            self._loop = loop
            self._staging.bind()
            if self._progress_mode == "thread":
                self._progress = ThreadProgress(
                    self._engine, loop, self._on_events, self._busy_poll_us, self._poll_yield_us
                )
            else:
                self._progress = LoopProgress(self._engine, loop, self._on_events, self._busy)
            self._hb_timer = loop.call_later(self._heartbeat, self._beat)
        elif loop is not self._loop:
            raise InvalidArgument("a UcxAgent is bound to the asyncio loop that first used it")
        return loop

    def _busy(self) -> bool:
        return bool(self._ops) or bool(self._staging.tasks)

    def _kick(self) -> None:
        if self._progress is not None:
            self._progress.kick()

    def _beat(self) -> None:
        """Ping every peer; declare gone those not heard from in peer_timeout."""
        if self._closed or self._loop is None:
            return
        now = time.monotonic()
        for p in self.peers:
            if p.error is not None:
                continue
            if now - p._last_heard > self._peer_timeout:
                self._peer_gone(p, PeerGone(f"peer {p.name[:8]} silent for {self._peer_timeout} s"))
            else:
                self._post(p, Message(Kind.PING, self.agent_id))
        self._hb_timer = self._loop.call_later(self._heartbeat, self._beat)

    def _peer_gone(self, peer: UcxPeer, exc: KVBridgeError, *, force: bool = False) -> None:
        """``peer`` died or closed: fail what it was part of and drop it
        (from ``peers`` too; a reconnect makes a new peer); ``force``: see
        ``_forget``."""
        peer._gone(exc)
        self._expectations.fail_peer(peer, peer.error or exc)
        self._forget(peer, force)

    # ---- events ------------------------------------------------------------------------------------
    def _on_events(self, drained: Any = None) -> None:
        """Account what the engine queued (``drained``: what a poll_drain()
        already took out of it)."""
        if self._closed or self._in_events:
            return
        self._in_events = True
        try:
            self._events(drained)
        finally:
            self._in_events = False

    def _events(self, drained: Any) -> None:
        """Account one drained batch: what arrived (puts that completed, DONEs
        that landed, messages) first, then the endpoints that failed.  A part
        that arrived before its sender's endpoint failed binds its receive to
        that sender, so the failure fails the receive at once; taking the
        failure first would leave an unbound receive waiting for its deadline
        on a sender that is gone (a DONE from a peer already dropped: see
        ``Expectations.on_landed``)."""
        results, failures, messages, landed = drained or self._engine.drain()
        for op, status in results:
            entry = self._ops.pop(op, None)
            if entry is None:
                continue
            if isinstance(entry, TransferHandle):
                self._put_done(entry, status)
            else:
                entry(status)
        # DONEs that landed in C++ before the messages of this batch: a part
        # applied here (a message below) may complete what they began.
        if landed:
            now = time.monotonic()
            for token, _l0, _l1, nbytes, sender, layers, complete in landed:
                peer = self._peers.get(sender)
                gone = None
                if peer is not None:
                    peer._last_heard = now
                else:
                    gone = self._gone_ids.get(sender)
                self._expectations.on_landed(token, nbytes, peer, layers, complete, gone)
        try:
            for raw in messages:
                try:
                    m = decode_message(raw)
                except VersionMismatch:
                    self._counts["dropped_version"] += 1
                    continue
                except KVBridgeError:
                    self._counts["dropped_malformed"] += 1
                    continue  # a malformed message from a peer is dropped
                self._dispatch(m)
        finally:  # a dispatch that raised does not keep the batch's failures from applying
            for ep, status in failures:
                peer = self._by_ep.get(ep)
                if peer is not None:
                    self._peer_gone(peer, ucs_error(status, f"peer {peer.name[:8]} gone"))

    def _put_done(self, h: TransferHandle, status: int) -> None:
        peer = h.owner if isinstance(h.owner, UcxPeer) else None
        if peer is not None:
            peer._untrack(h)
        if status == 0:
            h.finish()
        else:
            err = peer.error if peer is not None and peer.error else None
            h.fail(err or ucs_error(status, f"send {h.request_id!r}"))

    def _dispatch(self, m: Message) -> None:
        if m.kind is Kind.HELLO:
            self._hellos.on_hello(m)
            return
        if m.kind in (Kind.HELLO_ACK, Kind.HELLO_NACK):
            self._hellos.on_reply(m)
            return
        # the sender is the peer we issued the message's tag to, never an
        # agent id a message names
        peer = self._by_tag.get(m.sender)
        if peer is None or not peer._tx_tag:
            self._counts["dropped_unknown_sender"] += 1
            return  # not (or no longer) connected
        peer._last_heard = time.monotonic()
        if m.kind is Kind.PING:
            return
        if m.kind is Kind.BYE:
            self._peer_gone(peer, PeerGone(f"peer {peer.name[:8]} closed"))
        elif m.kind in (Kind.DONE, Kind.STAGE_REQ):
            try:
                if m.kind is Kind.DONE and not m.blob:
                    # a put (its DONE is encoded by the engine, without a blob)
                    # writes whole pages of the same layout: all our heads
                    heads = self.layout.head_range
                else:
                    heads = message_heads(m, self.layout.total_kv_heads)
            except KVBridgeError as e:
                self._reject(peer, m.rid, e)
                return
            self._expectations.on_part(peer, m, heads)
        elif m.kind in (Kind.STAGE_READY, Kind.STAGE_CHUNK):
            self._staging.on_message(peer, m)
        elif m.kind is Kind.ABORT:
            exc = error_for_code(abort_code_v2(m), m.text)
            # our sends of it stop posting (runs not posted yet never are)
            peer._receiver_aborted(m.rid, exc)
            try:
                named = message_heads(m, self.layout.total_kv_heads) if m.blob else None
            except KVBridgeError:
                named = None  # a malformed head range: every part of the request from it
            self._expectations.on_abort(peer, m.rid, named, exc)
            # after a flush: every put of ours posted before has landed there
            self._post(peer, Message(Kind.ABORT_ACK, self.agent_id, m.rid), flushed=True)
        elif m.kind is Kind.ABORT_ACK:
            self._acked(peer, m.rid)

    def _reject(self, peer: UcxPeer, rid: str, why: KVBridgeError) -> None:
        """Refuse ``peer``'s part of ``rid``: an ABORT it must acknowledge
        (receives of ``rid`` are held until it did)."""
        msg = Message(Kind.ABORT, self.agent_id, rid, code=code_for_error(why), text=str(why))
        self._send_abort(peer, rid, msg)
