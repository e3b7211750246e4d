"""The UCX transport: one-sided puts of KV pages between registered caches.

``UcxAgent(layout, cache)`` registers the cache (one region per layer tensor,
or one for a stacked cache) and a staging buffer once, at start.  Its
``metadata()`` bytes let a peer ``connect()``; then ``peer.send(...)`` writes a
token range (and layer range) of a request straight into the peer's cache when
both layouts are the same (``exact_hash``), or packs it into the staging buffer,
puts it into the peer's staging buffer and lets the peer unpack it when only the
wire layout matches (``compat_hash``).  ``agent.expect(...)`` completes when the
bytes have landed.  See docs/ucx.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._waits import wait_within
from ...errors import (
    Cancelled,
    ConnectTimeout,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    LayoutError,
    PeerGone,
    RemoteProtocolError,
    TransferAborted,
    TransferTimeout,
    Unavailable,
)
from ...layout import KVLayout
from .handle import TransferHandle, TransferStats
from .memory import buffer_of, cache_tensors
from .messages import MAX_HELLO_BLOB, Kind, Message, decode_message, encode_message
from .metadata import (
    AgentMetadata,
    RegionInfo,
    RegionKind,
    check_layouts,
    decode_metadata,
    encode_metadata,
)
from .progress import WorkerProgress
from .runs import CacheGeometry, put_runs

__all__ = [
    "TransferHandle",
    "TransferStats",
    "UcxAgent",
    "UcxPeer",
    "available",
    "unavailable_reason",
]

_ucx: Any = None
_reason = ""


def _load() -> Any:
    global _ucx, _reason
    if _ucx is not None or _reason:
        return _ucx
    try:
        import libucx  # the wheel's libucp/libucs, loaded before our module

        libucx.load_library()
    except ImportError:
        pass  # a system UCX found through the module's RPATH / ld.so
    try:
        from ... import _ucx as mod
    except ImportError as e:
        _reason = f"kvbridge._ucx is not built or cannot load ({e}); build with UCX headers present"
        return None
    _ucx = mod
    return mod


def available() -> bool:
    """Whether the UCX path can be used in this process."""
    return _load() is not None


def unavailable_reason() -> str:
    """Why UCX is unavailable ('' when it is available)."""
    _load()
    return _reason


# UCS statuses that mean the peer or the path to it is gone.
_GONE = (
    "ERR_UNREACHABLE",
    "ERR_NOT_CONNECTED",
    "ERR_CONNECTION_RESET",
    "ERR_ENDPOINT_TIMEOUT",
    "ERR_TIMED_OUT",
    "ERR_IO_ERROR",
    "ERR_REJECTED",
    "ERR_CANCELED",
)


def _status_error(status: int, what: str) -> KVBridgeError:
    mod = _load()
    name = {v: k for k, v in mod.STATUS.items()}.get(status, "")
    text = f"{what}: {mod.status_string(status)}"
    if name in _GONE:
        return PeerGone(text)
    if name == "ERR_INVALID_PARAM":
        return InvalidArgument(text)
    return KVBridgeError(text)


def _map_ucs(exc: BaseException, what: str) -> KVBridgeError:
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) == 2 and isinstance(args[0], int):
        return _status_error(args[0], f"{what}: {args[1]}")
    return KVBridgeError(f"{what}: {exc}")


# UCX settings kvbridge applies unless the environment sets them (UCX_<name>).
# Larger TCP segments let one put move in fewer fragments (2x over loopback here).
DEFAULT_UCX_CONFIG = {
    "KEEPALIVE_INTERVAL": "1s",
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
}

ABORT_CANCELLED = 1
ABORT_TIMEOUT = 2
ABORT_PROTOCOL = 3


@dataclass
class _Expect:
    handle: TransferHandle
    block_table: np.ndarray
    start: int
    end: int
    l0: int
    l1: int
    peer: UcxPeer | None
    landed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


class UcxPeer:
    """A connected remote agent.  Create with :meth:`UcxAgent.connect`."""

    def __init__(self, agent: UcxAgent, md: AgentMetadata, ep: int, same_layout: bool) -> None:
        self.agent = agent
        self.metadata = md
        self.ep = ep
        self.same_layout = same_layout
        self.name = md.agent_id.hex()
        self.error: KVBridgeError | None = None
        self.last_heard = time.monotonic()
        self.geometry = CacheGeometry(md.layout, md.num_pages)
        regions = list(md.regions)
        self._cache_region_ids = np.array(
            [i for i, r in enumerate(regions) if r.kind is RegionKind.CACHE], dtype=np.int64
        )
        self._staging_index = md.staging_region()
        self._sends: dict[int, TransferHandle] = {}
        self._ready: dict[tuple[str, int], asyncio.Queue[Message]] = {}

    @property
    def layout(self) -> KVLayout:
        return self.metadata.layout

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.agent._closed:
            raise Cancelled("the UCX agent is closed")

    def send(
        self,
        request_id: str,
        block_table: Any,
        remote_block_table: Any,
        start: int,
        end: int,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
        path: str | None = None,
    ) -> TransferHandle:
        """Send tokens ``[start, end)`` of layers ``layers`` (all when None) from
        our pages ``block_table`` into the peer's pages ``remote_block_table``.
        ``path`` forces "put" or "staging"; by default the put path is taken
        when both layouts are the same and the runs are not tiny."""
        self._check()
        a = self.agent
        lay = a.layout
        l0, l1 = lay.layer_range(layers)
        if not 0 <= start <= end:
            raise LayoutError(f"bad token range [{start}, {end})")
        h = TransferHandle(a._loop_now(), str(request_id), "send", timeout or a.timeout, a._abort)
        h._peer = self
        runs = None
        if self.same_layout and path != "staging":
            runs = put_runs(
                a.geometry,
                block_table,
                self.geometry,
                remote_block_table,
                start,
                end,
                (l0, l1),
                a._cache_region_ids,
                self._cache_region_ids,
            )
            nbytes = int(runs[:, 4].sum()) if runs.size else 0
            tiny = runs.shape[0] > 0 and nbytes // runs.shape[0] < a.min_put_run_bytes
            if path != "put" and tiny and a._pack_available() and self._staging_index is not None:
                runs = None
        elif path == "put":
            raise LayoutError("the put path needs both caches to have the same memory layout")
        if runs is not None:
            h.stats.path = "put"
            h.stats.runs = int(runs.shape[0])
            h.stats.bytes = nbytes
            notify = encode_message(
                Message(Kind.DONE, a.agent_id, str(request_id), start, end, l0, l1, nbytes)
            )
            try:
                op = a._engine.put(self.ep, np.ascontiguousarray(runs), notify)
            except Exception as e:
                err = _map_ucs(e, "UCX put")
                h._fail(err)
                raise err from e
            a._ops[op] = (h, None)
            self._sends[id(h)] = h
            a._kick()
            return h
        # staging path
        if self._staging_index is None or a._staging is None:
            raise Unavailable("the staging path needs a staging buffer on both agents")
        a._require_pack()
        h.stats.path = "staging"
        h.stats.bytes = lay.wire_nbytes(end - start, (l0, l1))
        self._sends[id(h)] = h
        task = a._loop_now().create_task(a._staged_send(self, h, block_table, start, end, l0, l1))
        h._task = task
        a._tasks.add(task)
        task.add_done_callback(a._tasks.discard)
        return h

    def expect(
        self,
        request_id: str,
        block_table: Any,
        start: int,
        end: int,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
    ) -> TransferHandle:
        """Expect ``request_id`` from this peer (fails with PeerGone if it dies)."""
        self._check()
        return self.agent.expect(
            request_id, block_table, start, end, layers, timeout=timeout, peer=self
        )

    def _fail_all(self, exc: KVBridgeError) -> None:
        if self.error is None:
            self.error = exc
        for h in list(self._sends.values()):
            h._fail(exc)
            task = h._task
            if task is not None:
                task.cancel()
        self._sends.clear()
        for ex in list(self.agent._expects.values()):
            if ex.peer is self:
                ex.handle._fail(exc)
                self.agent._drop_expect(ex)

    async def close(self) -> None:
        """Say goodbye and release the endpoint."""
        a = self.agent
        if self.error is None and not a._closed:
            with contextlib.suppress(Exception):
                op = a._engine.send(self.ep, encode_message(Message(Kind.BYE, a.agent_id)))
                await a._wait_op(op, 1.0)
        self._fail_all(Cancelled("peer connection closed locally"))
        a._forget_peer(self)


_NP_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "uint16"}


def _typed(layout: KVLayout, t: Any) -> Any:
    """A view of a cache tensor with the element type the pack core checks
    (the agent itself accepts any array of the right item size)."""
    if isinstance(t, np.ndarray):
        want = np.dtype(_NP_DTYPES.get(layout.dtype.value, "uint8"))
        return t if t.dtype == want else t.view(want)
    return t


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
        timeout: float = 30.0,
        min_put_run_bytes: int = 2048,
        error_mode: str = "none",
        heartbeat: float = 1.0,
        peer_timeout: float = 10.0,
        config: dict[str, str] | None = None,
        packer: Any = None,
    ) -> None:
        mod = _load()
        if mod is None:
            raise Unavailable(f"UCX transport unavailable: {_reason}")
        self.layout = layout
        self.cache = cache
        self.timeout = float(timeout)
        self.min_put_run_bytes = int(min_put_run_bytes)
        if error_mode not in ("peer", "none"):
            raise InvalidArgument(f"error_mode must be 'peer' or 'none', not {error_mode!r}")
        self.error_mode = error_mode
        if heartbeat <= 0 or peer_timeout <= heartbeat:
            raise InvalidArgument("need 0 < heartbeat < peer_timeout")
        self.heartbeat = float(heartbeat)
        self.peer_timeout = float(peer_timeout)
        self._hb_timer: asyncio.TimerHandle | None = None
        self._packer = packer
        self._tensors, self.num_pages = cache_tensors(layout, cache)
        self.geometry = CacheGeometry(layout, self.num_pages)
        cfg = {k: v for k, v in DEFAULT_UCX_CONFIG.items() if f"UCX_{k}" not in os.environ}
        cfg.update(config or {})
        try:
            self._engine = mod.Engine(list(cfg.items()))
        except mod.UcsError as e:
            raise Unavailable(f"UCX could not start: {e.args[-1]}") from None
        self.agent_id = os.urandom(16)
        self.epoch = time.time_ns()
        regions: list[RegionInfo] = []
        ids = []
        try:
            for layer, t in enumerate(self._tensors):
                addr, nbytes, _, _ = buffer_of(t)
                rid = self._engine.register_region(addr, nbytes)
                ids.append(rid)
                regions.append(
                    RegionInfo(
                        RegionKind.CACHE,
                        0 if layout.stacked else layer,
                        addr,
                        nbytes,
                        self._engine.rkey(rid),
                    )
                )
            self._staging: np.ndarray | None = None
            self._staging_region = 0
            if staging_bytes > 0:
                self._staging = np.zeros(int(staging_bytes), dtype=np.uint8)
                addr = self._staging.ctypes.data
                self._staging_region = self._engine.register_region(addr, self._staging.nbytes)
                regions.append(
                    RegionInfo(
                        RegionKind.STAGING,
                        0,
                        addr,
                        self._staging.nbytes,
                        self._engine.rkey(self._staging_region),
                    )
                )
        except Exception as e:
            self._engine.close()
            raise _map_ucs(e, "UCX memory registration") from None
        self._cache_region_ids = np.array(ids, dtype=np.int64)
        self._md = AgentMetadata(
            self.agent_id,
            self.epoch,
            layout,
            self.num_pages,
            self._engine.address(),
            tuple(regions),
        )
        self._blob = encode_metadata(self._md)
        if len(self._blob) > MAX_HELLO_BLOB:
            self._engine.close()
            raise InvalidArgument(
                f"UCX registration metadata of {len(self._blob)} bytes does not fit in a "
                f"HELLO ({MAX_HELLO_BLOB}): too many regions or too long remote keys"
            )
        nslots = max(1, int(staging_slots)) if staging_bytes > 0 else 0
        self._slot_bytes = (staging_bytes // nslots) if nslots else 0
        self._slot_offsets = [i * self._slot_bytes for i in range(nslots)]
        self._slots: asyncio.Queue[int] | None = None
        self._peers: dict[bytes, UcxPeer] = {}
        self._by_ep: dict[int, UcxPeer] = {}
        self._ops: dict[int, tuple[TransferHandle | None, asyncio.Future[None] | None]] = {}
        self._expects: dict[str, _Expect] = {}
        self._early: dict[str, list[tuple[UcxPeer, Message]]] = {}
        self._aborted: dict[str, None] = {}  # recently failed expects: drop late parts
        self._hello: dict[bytes, asyncio.Future[Message]] = {}
        self._chunks: dict[tuple[bytes, str, int], asyncio.Queue[Message]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._progress: WorkerProgress | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.on_peer: Any = None  # optional callback(UcxPeer) for accepted peers
        with contextlib.suppress(RuntimeError):  # created inside a running loop: serve now
            self._loop_now()

    def start(self) -> None:
        """Bind to the running asyncio loop and start answering peers (done
        automatically when the agent is created inside a running loop)."""
        self._loop_now()

    # ---- identity ---------------------------------------------------------------
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

    # ---- loop / progress ----------------------------------------------------------
    def _loop_now(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise Cancelled("the UCX agent is closed")
        if self._loop is None:
            self._loop = loop
            self._slots = asyncio.Queue()
            for off in self._slot_offsets:
                self._slots.put_nowait(off)
            self._progress = WorkerProgress(self._engine, loop, self._on_events, self._busy)
            self._hb_timer = loop.call_later(self.heartbeat, self._beat)
        elif loop is not self._loop:
            raise InvalidArgument("a UcxAgent is bound to the asyncio loop that first used it")
        return loop

    def _beat(self) -> None:
        """Ping every peer; declare gone those not heard from in peer_timeout."""
        if self._closed or self._loop is None:
            return
        now = time.monotonic()
        for p in self.peers:
            if p.error is not None:
                continue
            if now - p.last_heard > self.peer_timeout:
                p._fail_all(PeerGone(f"peer {p.name[:8]} silent for {self.peer_timeout} s"))
            else:
                self._send_msg(p, Message(Kind.PING, self.agent_id))
        self._hb_timer = self._loop.call_later(self.heartbeat, self._beat)

    def _busy(self) -> bool:
        return bool(self._ops) or bool(self._tasks)

    def _kick(self) -> None:
        if self._progress is not None:
            self._progress.kick()

    def _on_events(self) -> None:
        results, failures, messages = self._engine.drain()
        for ep, status in failures:
            peer = self._by_ep.get(ep)
            if peer is not None:
                peer._fail_all(_status_error(status, f"peer {peer.name[:8]} gone"))
        for op, status in results:
            entry = self._ops.pop(op, None)
            if entry is None:
                continue
            h, fut = entry
            if h is not None:
                peer = h._peer
                if peer is not None:
                    peer._sends.pop(id(h), None)
                if status == 0:
                    h._finish()
                else:
                    err = peer.error if peer is not None and peer.error else None
                    h._fail(err or _status_error(status, f"send {h.request_id!r}"))
            if fut is not None and not fut.done():
                if status == 0:
                    fut.set_result(None)
                else:
                    fut.set_exception(_status_error(status, "UCX operation"))
        for raw in messages:
            try:
                self._dispatch(decode_message(raw))
            except KVBridgeError:
                continue  # a malformed message from a peer is dropped

    async def _wait_op(self, op: int, timeout: float) -> None:
        fut: asyncio.Future[None] = self._loop_now().create_future()
        self._ops[op] = (None, fut)
        self._kick()

        def expired() -> TransferTimeout:
            self._ops.pop(op, None)
            return TransferTimeout(f"UCX operation not complete within {timeout} s")

        await wait_within(fut, timeout, expired)

    def _send_msg(self, peer: UcxPeer, msg: Message) -> asyncio.Future[None] | None:
        if peer.error is not None or self._closed:
            return None
        try:
            op = self._engine.send(peer.ep, encode_message(msg))
        except Exception as e:
            peer._fail_all(_map_ucs(e, "UCX message"))
            return None
        fut: asyncio.Future[None] = self._loop_now().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._ops[op] = (None, fut)
        self._kick()
        return fut

    # ---- connecting -----------------------------------------------------------------
    async def connect(self, remote_metadata: bytes, *, timeout: float | None = None) -> UcxPeer:
        """Connect to the agent described by ``remote_metadata``; checks that
        the blob is intact and current (a hello answered by that very agent
        incarnation) and that the layouts fit.  Returns the peer."""
        loop = self._loop_now()
        md = decode_metadata(remote_metadata)
        same = check_layouts(self.layout, md.layout)
        if md.agent_id == self.agent_id:
            raise InvalidArgument("cannot connect an agent to itself")
        old = self._peers.get(md.agent_id)
        if old is not None and old.error is None:
            return old
        peer = self._make_peer(md, same)
        fut: asyncio.Future[Message] = loop.create_future()
        self._hello[md.agent_id] = fut
        hello = Message(Kind.HELLO, self.agent_id, code=md.epoch, blob=self._blob)
        self._send_msg(peer, hello)
        t = timeout or self.timeout
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), t)
        except KVBridgeError:  # first: our timeout errors are TimeoutErrors too
            self._forget_peer(peer)
            raise
        except TimeoutError:
            self._forget_peer(peer)
            raise ConnectTimeout(
                f"UCX peer {peer.name[:8]} did not answer within {t} s (stale metadata?)"
            ) from None
        finally:
            self._hello.pop(md.agent_id, None)
        if reply.kind is Kind.HELLO_NACK:
            self._forget_peer(peer)
            raise IncompatiblePeer(f"UCX peer refused the connection: {reply.text}")
        return peer

    def _make_peer(self, md: AgentMetadata, same: bool) -> UcxPeer:
        regions = [(r.base, r.length, r.rkey) for r in md.regions]
        try:
            ep = self._engine.connect(md.address, regions, self.error_mode == "peer")
        except Exception as e:
            raise _map_ucs(e, "UCX connect") from None
        peer = UcxPeer(self, md, ep, same)
        self._peers[md.agent_id] = peer
        self._by_ep[ep] = peer
        return peer

    def _forget_peer(self, peer: UcxPeer) -> None:
        if self._peers.get(peer.metadata.agent_id) is peer:
            del self._peers[peer.metadata.agent_id]
        self._by_ep.pop(peer.ep, None)
        if not self._closed:
            self._engine.disconnect(peer.ep)

    def _forget_after(self, peer: UcxPeer, _fut: object) -> None:
        self._forget_peer(peer)

    def _on_hello(self, m: Message) -> None:
        try:
            md = decode_metadata(m.blob)
            if md.agent_id != m.sender:
                raise RemoteProtocolError("hello sender does not match its metadata")
            if m.code != self.epoch:
                raise IncompatiblePeer(
                    "stale metadata: it names an earlier incarnation of this agent"
                )
            same = check_layouts(self.layout, md.layout)
        except KVBridgeError as e:
            with contextlib.suppress(Exception):
                md2 = decode_metadata(m.blob)
                tmp = self._make_peer(md2, False)
                fut = self._send_msg(tmp, Message(Kind.HELLO_NACK, self.agent_id, text=str(e)))
                if fut is not None:
                    fut.add_done_callback(functools.partial(self._forget_after, tmp))
            return
        old = self._peers.get(md.agent_id)
        if old is not None and old.error is None and old.metadata.epoch == md.epoch:
            peer = old  # both sides connected to each other: keep one endpoint each
        else:
            if old is not None:
                self._forget_peer(old)
            peer = self._make_peer(md, same)
        self._send_msg(peer, Message(Kind.HELLO_ACK, self.agent_id))
        if self.on_peer is not None:
            self.on_peer(peer)

    # ---- receiving ---------------------------------------------------------------------
    def expect(
        self,
        request_id: str,
        block_table: Any,
        start: int,
        end: int,
        layers: tuple[int, int] | None = None,
        *,
        timeout: float | None = None,
        peer: UcxPeer | None = None,
    ) -> TransferHandle:
        """Expect tokens ``[start, end)`` of ``layers`` of ``request_id`` into our
        pages ``block_table``.  The handle completes when every layer of the
        range has landed (it may arrive in several layer-range sends)."""
        loop = self._loop_now()
        rid = str(request_id)
        if rid in self._expects:
            raise InvalidArgument(f"request {rid!r} is already expected")
        l0, l1 = self.layout.layer_range(layers)
        if not 0 <= start <= end:
            raise LayoutError(f"bad token range [{start}, {end})")
        bt = np.asarray(block_table, dtype=np.int64).reshape(-1)
        # Validate the block table now (raises PageIndexError).
        from .runs import page_pieces

        page_pieces(self.geometry, bt, start, end, (l0, l1))
        h = TransferHandle(loop, rid, "recv", timeout or self.timeout, self._abort)
        ex = _Expect(h, bt, start, end, l0, l1, peer, np.zeros(l1 - l0, dtype=bool))
        h._expect = ex
        self._expects[rid] = ex
        if l0 == l1 or start == end:
            h._finish()
            self._drop_expect(ex)
            return h
        self._aborted.pop(rid, None)
        for p, msg in self._early.pop(rid, []):
            self._deliver(ex, p, msg)
        return h

    def _drop_expect(self, ex: _Expect) -> None:
        rid = ex.handle.request_id
        if self._expects.get(rid) is ex:
            del self._expects[rid]
        if ex.handle.exception() is not None:
            self._aborted[rid] = None
            if len(self._aborted) > 4096:
                del self._aborted[next(iter(self._aborted))]

    def _deliver(self, ex: _Expect, peer: UcxPeer, m: Message) -> None:
        h = ex.handle
        if h.done():
            return
        if ex.peer is None:
            ex.peer = peer
        elif ex.peer is not peer:
            self._reject(peer, m.rid, f"request {m.rid!r} is expected from another peer")
            return
        if m.start != ex.start or m.end != ex.end or not ex.l0 <= m.l0 <= m.l1 <= ex.l1:
            err = RemoteProtocolError(
                f"{m.rid!r}: peer sent tokens [{m.start}, {m.end}) layers [{m.l0}, {m.l1}), "
                f"expected tokens [{ex.start}, {ex.end}) layers [{ex.l0}, {ex.l1})"
            )
            h._fail(err)
            self._drop_expect(ex)
            self._reject(peer, m.rid, str(err))
            return
        if m.kind is Kind.DONE:
            h.stats.path = h.stats.path or "put"
            h.stats.bytes += m.nbytes
            self._landed(ex, m.l0, m.l1)
        elif m.kind is Kind.STAGE_REQ:
            h.stats.path = "staging"
            task = self._loop_now().create_task(self._staged_recv(ex, peer, m))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _landed(self, ex: _Expect, l0: int, l1: int) -> None:
        ex.landed[l0 - ex.l0 : l1 - ex.l0] = True
        ex.handle.stats.layers_done = int(ex.landed.sum())
        if ex.landed.all():
            ex.handle._finish()
            self._drop_expect(ex)

    def _reject(self, peer: UcxPeer, rid: str, text: str) -> None:
        self._send_msg(
            peer, Message(Kind.ABORT, self.agent_id, rid, code=ABORT_PROTOCOL, text=text)
        )

    # ---- dispatch ---------------------------------------------------------------------------
    def _dispatch(self, m: Message) -> None:
        if m.kind is Kind.HELLO:
            self._on_hello(m)
            return
        if m.kind in (Kind.HELLO_ACK, Kind.HELLO_NACK):
            fut = self._hello.get(m.sender)
            if fut is not None and not fut.done():
                fut.set_result(m)
            return
        peer = self._peers.get(m.sender)
        if peer is None:
            return  # not (or no longer) connected
        peer.last_heard = time.monotonic()
        if m.kind is Kind.PING:
            return
        if m.kind is Kind.BYE:
            peer._fail_all(PeerGone(f"peer {peer.name[:8]} closed"))
            self._forget_peer(peer)
        elif m.kind in (Kind.DONE, Kind.STAGE_REQ):
            ex = self._expects.get(m.rid)
            if ex is None and m.rid in self._aborted:
                if m.kind is Kind.STAGE_REQ:
                    self._reject(peer, m.rid, f"request {m.rid!r} was aborted here")
            elif ex is None:
                early = self._early.setdefault(m.rid, [])
                if len(self._early) > 65536 or len(early) > 4096:
                    self._early.pop(m.rid, None)
                    self._reject(peer, m.rid, "too many unexpected requests")
                else:
                    early.append((peer, m))
            else:
                self._deliver(ex, peer, m)
        elif m.kind in (Kind.STAGE_READY, Kind.STAGE_CHUNK):
            q = self._chunks.get((m.sender, m.rid, m.part))
            if q is not None:
                q.put_nowait(m)
        elif m.kind is Kind.ABORT:
            exc: KVBridgeError = TransferAborted(m.text, m.code)
            for h in list(peer._sends.values()):
                if h.request_id == m.rid:
                    h._fail(exc)
                    peer._sends.pop(id(h), None)
                    task = h._task
                    if task is not None:
                        task.cancel()
            ex = self._expects.get(m.rid)
            if ex is not None and ex.peer in (None, peer):
                ex.handle._fail(exc)
                self._drop_expect(ex)
            self._early.pop(m.rid, None)

    def _abort(self, h: TransferHandle, exc: KVBridgeError) -> None:
        """A handle was cancelled or timed out locally: tell the peer."""
        code = ABORT_TIMEOUT if isinstance(exc, TransferTimeout) else ABORT_CANCELLED
        task = h._task
        if task is not None:
            task.cancel()
        peer: UcxPeer | None = h._peer
        ex: _Expect | None = h._expect
        if ex is not None:
            self._drop_expect(ex)
            peer = ex.peer
        if peer is not None:
            peer._sends.pop(id(h), None)
            self._send_msg(
                peer, Message(Kind.ABORT, self.agent_id, h.request_id, code=code, text=str(exc))
            )

    # ---- staging path -----------------------------------------------------------------------
    def _pack_module(self) -> Any:
        """The pack/unpack implementation of the staging path: ``packer``
        if given, else :mod:`kvbridge.pack` (None when neither exists)."""
        if self._packer is None:
            try:
                from ... import pack as mod
            except ImportError:
                return None
            self._packer = mod
        return self._packer

    def _pack_available(self) -> bool:
        return self._pack_module() is not None

    def _require_pack(self) -> None:
        if not self._pack_available():
            raise Unavailable(
                "the staging path needs kvbridge.pack (the pack core), which is not built"
            )

    def _paged_cache(self) -> Any:
        mod = self._pack_module()
        if isinstance(self.cache, mod.PagedKVCache):
            return self.cache
        if getattr(self, "_pkv", None) is None:
            typed = [_typed(self.layout, t) for t in self._tensors]
            self._pkv = mod.PagedKVCache(self.layout, typed[0] if self.layout.stacked else typed)
        return self._pkv

    async def _slot(self) -> int:
        assert self._slots is not None
        return await self._slots.get()

    def _release(self, off: int) -> None:
        assert self._slots is not None
        self._slots.put_nowait(off)

    async def _staged_send(
        self, peer: UcxPeer, h: TransferHandle, bt: Any, start: int, end: int, l0: int, l1: int
    ) -> None:
        pack = self._pack_module().pack
        assert self._staging is not None and peer._staging_index is not None
        part = id(h) & 0xFFFFFFFFFFFF
        key = (peer.metadata.agent_id, h.request_id, part)
        q: asyncio.Queue[Message] = asyncio.Queue()
        self._chunks[key] = q
        slot = await self._slot()
        try:
            total = h.stats.bytes
            req = Message(
                Kind.STAGE_REQ, self.agent_id, h.request_id, start, end, l0, l1, total, part
            )
            self._send_msg(peer, req)
            cache = self._paged_cache()
            # A real PagedKVCache checks the range once; a stand-in packer packs per call.
            rng = cache.range(bt, start, end, layers=(l0, l1)) if hasattr(cache, "range") else None
            done = 0
            while not h.done():
                ready = await q.get()
                if ready.kind is not Kind.STAGE_READY:
                    raise RemoteProtocolError("expected STAGE_READY")
                n = min(ready.length, self._slot_bytes, total - done)
                if n <= 0 and total > 0:
                    raise RemoteProtocolError("peer offered an empty staging slot")
                out = self._staging[slot : slot + n]
                if rng is not None:
                    rng.pack(out, offset=done, nbytes=n)
                else:
                    pack(cache, bt, start, end, layers=(l0, l1), out=out, offset=done, nbytes=n)
                last = done + n >= total
                chunk = Message(
                    Kind.STAGE_CHUNK,
                    self.agent_id,
                    h.request_id,
                    part=part,
                    offset=done,
                    length=n,
                    slot=ready.slot,
                    code=int(last),
                )
                runs = np.array(
                    [[self._staging_region, slot, peer._staging_index, ready.slot, n]],
                    dtype=np.uint64,
                )
                op = self._engine.put(peer.ep, runs, encode_message(chunk))
                await self._wait_op(op, self.timeout)
                h.stats.chunks += 1
                h.stats.runs += 1
                done += n
                if last:
                    h._finish()
        except asyncio.CancelledError:
            pass
        except KVBridgeError as e:
            if h._fail(peer.error or e):
                self._abort(h, e)
        except Exception as e:  # a pack error or a UCS error: typed for the caller
            err = _map_ucs(e, "staged send")
            if h._fail(err):
                self._abort(h, err)
        finally:
            self._chunks.pop(key, None)
            peer._sends.pop(id(h), None)
            self._release(slot)

    async def _staged_recv(self, ex: _Expect, peer: UcxPeer, req: Message) -> None:
        unpack = self._pack_module().unpack
        assert self._staging is not None
        h = ex.handle
        key = (peer.metadata.agent_id, req.rid, req.part)
        q: asyncio.Queue[Message] = asyncio.Queue()
        self._chunks[key] = q
        slot = await self._slot()
        try:
            expected = self.layout.wire_nbytes(req.end - req.start, (req.l0, req.l1))
            if req.nbytes != expected:
                raise RemoteProtocolError(f"staged part of {req.nbytes} bytes, expected {expected}")
            cache = self._paged_cache()
            rng = (
                cache.range(ex.block_table, req.start, req.end, layers=(req.l0, req.l1))
                if hasattr(cache, "range")
                else None
            )
            got = 0
            while not h.done():
                ready = Message(
                    Kind.STAGE_READY,
                    self.agent_id,
                    req.rid,
                    part=req.part,
                    slot=slot,
                    length=self._slot_bytes,
                )
                self._send_msg(peer, ready)
                chunk = await q.get()
                if (
                    chunk.kind is not Kind.STAGE_CHUNK
                    or chunk.offset != got
                    or chunk.length > self._slot_bytes
                ):
                    raise RemoteProtocolError("staging chunk out of order or too large")
                src = self._staging[slot : slot + chunk.length]
                if rng is not None:
                    rng.unpack(src, offset=chunk.offset)
                else:
                    unpack(
                        cache,
                        ex.block_table,
                        req.start,
                        req.end,
                        src,
                        layers=(req.l0, req.l1),
                        offset=chunk.offset,
                    )
                got += chunk.length
                h.stats.chunks += 1
                h.stats.bytes += chunk.length
                if chunk.code:
                    if got != expected:
                        raise RemoteProtocolError(
                            f"staged part ended after {got} of {expected} bytes"
                        )
                    self._landed(ex, req.l0, req.l1)
                    return
        except asyncio.CancelledError:
            pass
        except KVBridgeError as e:
            if h._fail(e):
                self._abort(h, e)
        finally:
            self._chunks.pop(key, None)
            self._release(slot)

    # ---- lifetime ---------------------------------------------------------------------------
    async def close(self) -> None:
        """Tell peers goodbye, fail what is in flight with Cancelled, release
        the endpoints, the registered memory and the worker."""
        if self._closed:
            return
        if self._loop is not None:
            byes = [self._send_msg(p, Message(Kind.BYE, self.agent_id)) for p in self.peers]
            waits = [f for f in byes if f is not None]
            if waits:
                with contextlib.suppress(Exception):
                    await asyncio.wait(waits, timeout=1.0)
        for p in self.peers:
            p._fail_all(Cancelled("the UCX agent closed"))
        for ex in list(self._expects.values()):
            ex.handle._fail(Cancelled("the UCX agent closed"))
        self._expects.clear()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._closed = True
        if self._hb_timer is not None:
            self._hb_timer.cancel()
        if self._progress is not None:
            self._progress.close()
        for _, fut in self._ops.values():
            if fut is not None and not fut.done():
                fut.cancel()
        self._ops.clear()
        self._engine.close()

    async def __aenter__(self) -> UcxAgent:
        self._loop_now()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
