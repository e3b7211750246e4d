"""The staging path: a request whose layouts differ (or whose runs are tiny)
is packed into the sender's registered staging buffer, put into the
receiver's staging buffer slot by slot, and unpacked there (docs/ucx.md).

Pack and unpack run on a worker thread (``staging_threads`` of them), never
on the event loop, so the loop and UCX progress go on while a chunk is being
packed.  A slot is released only after the thread that used it returned.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ...errors import KVBridgeError, RemoteProtocolError, Unavailable
from ...layout import KVLayout
from ...span import KVSpan
from .expect import Expect
from .handle import TransferHandle
from .messages import Kind, Message, encode_message, heads_blob

if TYPE_CHECKING:
    from .agent import UcxAgent
    from .peer import UcxPeer

__all__ = ["Staging"]

T = TypeVar("T")

_NP_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "uint16"}


def typed_view(layout: KVLayout, t: Any) -> Any:
    """A view of a cache tensor with the element type the pack core checks
    (the agent itself accepts any array of the right item size)."""
    if isinstance(t, np.ndarray):
        want = np.dtype(_NP_DTYPES.get(layout.dtype.value, "uint8"))
        return t if t.dtype == want else t.view(want)
    return t


class Staging:
    def __init__(
        self,
        host: UcxAgent,
        layout: KVLayout,
        cache: Any,
        tensors: list[Any],
        buffer: np.ndarray | None,
        region_id: int,
        slots: int,
        threads: int,
        packer: Any,
    ) -> None:
        self._host = host
        self._layout = layout
        self._cache = cache
        self._tensors = tensors
        self.buffer = buffer
        self.region_id = region_id
        nslots = max(1, int(slots)) if buffer is not None else 0
        self.slot_bytes = (buffer.nbytes // nslots) if buffer is not None and nslots else 0
        self._offsets = [i * self.slot_bytes for i in range(nslots)]
        self._slots: asyncio.Queue[int] | None = None
        self._chunks: dict[tuple[bytes, str, int], asyncio.Queue[Message]] = {}
        self._packer = packer
        self._pkv: Any = None
        self._threads = max(1, int(threads))
        self._pool: ThreadPoolExecutor | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    # ---- setup ------------------------------------------------------------------
    def bind(self) -> None:
        """Create the slot queue (on the agent's loop)."""
        self._slots = asyncio.Queue()
        for off in self._offsets:
            self._slots.put_nowait(off)

    @property
    def usable(self) -> bool:
        return self.buffer is not None

    def pack_module(self) -> Any:
        """``packer`` if given, else :mod:`kvbridge.pack` (None when neither exists)."""
        if self._packer is None:
            try:
                from ... import pack as mod
            except ImportError:
                return None
            self._packer = mod
        return self._packer

    @property
    def _ranges(self) -> bool:
        """Whether the packer is kvbridge.pack (whose caches make checked ranges),
        not a stand-in that packs per call (the torch reference, a test's)."""
        mod = self.pack_module()
        return getattr(mod, "__name__", "") == f"{__name__.split('.')[0]}.pack"

    def require(self, peer: UcxPeer) -> None:
        if self.buffer is None or peer._staging_index is None:
            raise Unavailable("the staging path needs a staging buffer on both agents")
        if self.pack_module() is None:
            raise Unavailable(
                "the staging path needs kvbridge.pack (the pack core), which is not built"
            )

    def _paged_cache(self) -> Any:
        mod = self.pack_module()
        if isinstance(self._cache, mod.PagedKVCache):
            return self._cache
        if self._pkv is None:
            typed = [typed_view(self._layout, t) for t in self._tensors]
            self._pkv = mod.PagedKVCache(self._layout, typed[0] if self._layout.stacked else typed)
        return self._pkv

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a staging thread; a cancellation waits for it to return
        (the slot it writes must not be reused before)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvb-staging")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def _spawn(self, coro: Any, h: TransferHandle | None = None) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        if h is not None:
            h.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ---- messages ---------------------------------------------------------------------
    def on_message(self, peer: UcxPeer, m: Message) -> None:
        """A STAGE_READY or STAGE_CHUNK from ``peer`` for one of our parts."""
        q = self._chunks.get((peer.agent_id, m.rid, m.part))
        if q is not None:
            q.put_nowait(m)

    # ---- sending ----------------------------------------------------------------------
    def start_send(self, peer: UcxPeer, h: TransferHandle, span: KVSpan) -> None:
        """Send ``span`` (resolved) of our cache through the staging slots."""
        self._spawn(self._send(peer, h, span), h)

    def _head_kw(self, heads: tuple[int, int] | None) -> dict[str, Any]:
        """``heads=`` for the pack calls when it is a sub-range of the cache's
        (a stand-in packer without head ranges sees the calls it knows)."""
        if heads is None or tuple(heads) == self._layout.head_range:
            return {}
        return {"heads": tuple(heads)}

    async def _send(self, peer: UcxPeer, h: TransferHandle, span: KVSpan) -> None:
        assert span.layers is not None
        l0, l1 = span.layers
        bt, start, end, heads = span.block_table, span.start, span.end, span.heads
        host = self._host
        pack = self.pack_module().pack
        assert self.buffer is not None and self._slots is not None
        assert peer._staging_index is not None
        part = id(h) & 0xFFFFFFFFFFFF
        key = (peer.agent_id, h.request_id, part)
        q: asyncio.Queue[Message] = asyncio.Queue()
        self._chunks[key] = q
        slot = await self._slots.get()
        try:
            total = h.total_bytes
            named = heads_blob(heads, self._layout.total_kv_heads)
            req = Message(
                Kind.STAGE_REQ,
                host.agent_id,
                h.request_id,
                start,
                end,
                l0,
                l1,
                total,
                part,
                blob=named,
            )
            host._post(peer, req)
            cache = self._paged_cache()
            kw = self._head_kw(heads)
            if self._ranges:  # kvbridge.pack checks the range once
                pack_at = cache.range(bt, start, end, layers=(l0, l1), writable=False, **kw).pack
            else:  # a stand-in packer packs per call
                pack_at = functools.partial(pack, cache, bt, start, end, layers=(l0, l1), **kw)
            done = 0
            while not h.settled:
                ready = await q.get()
                if ready.kind is not Kind.STAGE_READY:
                    raise RemoteProtocolError("expected STAGE_READY")
                n = min(ready.length, self.slot_bytes, total - done)
                if n <= 0 and total > 0:
                    raise RemoteProtocolError("peer offered an empty staging slot")
                out = self.buffer[slot : slot + n]
                await self._in_thread(functools.partial(pack_at, out=out, offset=done, nbytes=n))
                last = done + n >= total
                chunk = Message(
                    Kind.STAGE_CHUNK,
                    host.agent_id,
                    h.request_id,
                    part=part,
                    offset=done,
                    length=n,
                    slot=ready.slot,
                    code=int(last),
                )
                runs = np.array(
                    [[self.region_id, slot, peer._staging_index, ready.slot, n]], dtype=np.uint64
                )
                await host._put_and_wait(
                    peer, runs, encode_message(chunk, sender=peer._tx_tag), host._timeout, h
                )
                h.stats.chunks += 1
                h.stats.runs += 1
                done += n
                h.stats.bytes = done
                if last:
                    h.finish()
        except asyncio.CancelledError:
            pass
        except KVBridgeError as e:
            err = peer.error or e
            if h.fail(err):
                host._abort(h, err)
        except Exception as e:  # a pack error: typed for the caller
            err = KVBridgeError(f"staged send of {h.request_id!r}: {e!r}")
            if h.fail(err):
                host._abort(h, err)
        finally:
            self._chunks.pop(key, None)
            peer._untrack(h)
            self._slots.put_nowait(slot)

    # ---- receiving ----------------------------------------------------------------------
    def start_recv(self, ex: Expect, peer: UcxPeer, req: Message) -> None:
        """Receive a staged part; the receive's outcome is not reported while
        the task runs (its unpack writes into the pages)."""
        h = ex.handle
        task = self._spawn(self._recv(ex, peer, req))
        if h.recv_tasks is None:
            h.recv_tasks = set()
        h.recv_tasks.add(task)
        host = self._host

        def ended(t: asyncio.Task[None]) -> None:
            if h.recv_tasks is not None:
                h.recv_tasks.discard(t)
            if h.held:
                host._check_held_soon()

        task.add_done_callback(ended)

    async def _recv(self, ex: Expect, peer: UcxPeer, req: Message) -> None:
        host = self._host
        unpack = self.pack_module().unpack
        assert self.buffer is not None and self._slots is not None
        h = ex.handle
        key = (peer.agent_id, req.rid, req.part)
        q: asyncio.Queue[Message] = asyncio.Queue()
        self._chunks[key] = q
        slot = await self._slots.get()
        try:
            layers = (req.l0, req.l1)
            expected = self._layout.wire_nbytes(req.end - req.start, layers, ex.heads)
            if req.nbytes != expected:
                raise RemoteProtocolError(f"staged part of {req.nbytes} bytes, expected {expected}")
            cache = self._paged_cache()
            bt, kw = ex.block_table, self._head_kw(ex.heads)
            if self._ranges:  # kvbridge.pack checks the range once
                unpack_at = cache.range(bt, req.start, req.end, layers=layers, **kw).unpack
            else:  # a stand-in packer unpacks per call
                unpack_at = functools.partial(
                    unpack, cache, bt, req.start, req.end, layers=layers, **kw
                )
            got = 0
            while not h.settled:
                ready = Message(
                    Kind.STAGE_READY,
                    host.agent_id,
                    req.rid,
                    part=req.part,
                    slot=slot,
                    length=self.slot_bytes,
                )
                host._post(peer, ready)
                chunk = await q.get()
                if h.settled:  # ended meanwhile: its pages are not ours to write
                    break
                if (
                    chunk.kind is not Kind.STAGE_CHUNK
                    or chunk.offset != got
                    or chunk.length > self.slot_bytes
                ):
                    raise RemoteProtocolError("staging chunk out of order or too large")
                src = self.buffer[slot : slot + chunk.length]
                await self._in_thread(functools.partial(unpack_at, src, offset=chunk.offset))
                got += chunk.length
                h.stats.chunks += 1
                h.stats.bytes += chunk.length
                if chunk.code:
                    if got != expected:
                        raise RemoteProtocolError(
                            f"staged part ended after {got} of {expected} bytes"
                        )
                    host._landed(ex, req.l0, req.l1)
                    return
        except asyncio.CancelledError:
            pass
        except KVBridgeError as e:
            if h.fail(e):
                host._abort(h, e)
        except Exception as e:  # an unpack error: typed for the caller
            err = KVBridgeError(f"staged receive of {req.rid!r}: {e!r}")
            if h.fail(err):
                host._abort(h, err)
        finally:
            self._chunks.pop(key, None)
            slots = self._slots
            if h.exception() is not None:
                # the sender may still have a chunk on its way into the slot:
                # reused once it acknowledged our ABORT (or was disconnected)
                host._after_quiet(peer, req.rid, lambda: slots.put_nowait(slot))
            else:
                slots.put_nowait(slot)

    # ---- lifetime ------------------------------------------------------------------------
    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
