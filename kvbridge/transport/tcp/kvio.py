"""Data sources and sinks: what the transport reads from and writes to.

The transport knows no KV.  A :class:`Source` gives the wire bytes of any
slice ``[offset, offset + n)`` of a transfer; a :class:`Sink` stores verified
bytes at an offset, in any order, each byte at most once.  Both are called
from worker threads (the pack core releases the GIL).

:class:`KVSource` / :class:`KVSink` are the KV-cache implementations on top of
:mod:`kvbridge.pack`: the wire bytes of a token range and layer range of one
request, packed from (unpacked into) its pages on the fly, so no buffer of the
whole transfer ever exists.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ...errors import BufferTooSmall, InvalidArgument
from ...span import KVSpan, as_span

__all__ = ["BytesSink", "BytesSource", "KVSink", "KVSource", "Sink", "Source"]


@runtime_checkable
class Source(Protocol):
    nbytes: int  # total wire bytes
    itemsize: int  # element size (2 enables the byte shuffle before compression)
    layout_hash: int  # KVLayout.compat_hash, 0 for plain bytes
    token_range: tuple[int, int]
    layer_range: tuple[int, int]

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes ``[offset, offset + len(out))``."""


@runtime_checkable
class Sink(Protocol):
    nbytes: int
    layout_hash: int
    token_range: tuple[int, int]
    layer_range: tuple[int, int]

    def write(self, offset: int, data: memoryview) -> None:
        """Store verified bytes at ``offset`` (called once per byte, any order)."""

    def flush(self) -> None:
        """Make every written byte visible to the engine (e.g. sync a CUDA stream)."""


# A source may also offer either of
#
#     def view(self, offset: int, n: int) -> memoryview   (the bytes themselves)
#     def read(self, offset: int, n: int) -> memoryview   (a new buffer it filled)
#
# ``view`` lends bytes that are already in wire form (no copy at all); ``read``
# hands over a buffer in which the source wrote every byte, so the transport
# need not zero-fill one for ``read_into`` first (a whole memory pass per chunk).
#
# Or, when its bytes sit in its own memory as runs of some length (the pages
# of a KV cache), it may offer
#
#     def views(self, offset: int, n: int) -> list[memoryview] | None
#
# the runs themselves, in order, their concatenation the bytes
# ``[offset, offset + n)`` (None: not for this slice; the transport then packs
# it as without ``views``).  The transport hashes the runs and writes them
# with the frame header in one gathering write: no copy but the kernel's.
# As with ``view``, the bytes must stay unchanged until the transfer ends.
#
# A source with ``read`` that fills a small buffer without blocking (a CPU
# pack, not a wait for a device) may say so with ``read_on_loop = True``: the
# sender then prepares its small chunks on the event loop, without a hop to a
# worker thread (kvbridge.transport.tcp.prepare.inline_limit).
#
# A sink whose bytes are plain contiguous host memory may also offer
#
#     def view(self, offset: int, n: int) -> memoryview   (writable, exactly n bytes)
#
# The receiver then reads uncompressed chunks from the socket straight into it,
# with no copy.  Those bytes land before their checksum is verified: a damaged
# chunk is asked for again and overwritten, and a cancelled transfer stops
# writing there at once.  The engine reads nothing before completion anyway.
#
# Checksums in the copy.  A source may also offer
#
#     def read_checksummed(self, offset: int, n: int) -> tuple[memoryview, int]
#
# (a new buffer of the bytes, as ``read``, and their XXH3-64, computed in the
# pass that wrote them), and a sink
#
#     def write_checksummed(self, offset: int, data: memoryview, checksum: int) -> None
#
# (store the bytes, verifying in the same pass that they hash to ``checksum``;
# on a mismatch raise kvbridge.errors.ChecksumError).  The transport then
# reads each raw chunk once on each side beyond the kernel's copies: the
# sender does not hash the chunk again, the receiver does not hash it as it
# arrives.  A damaged chunk has then reached the sink's memory before the
# mismatch was found (as with a sink that lends its memory): it is asked
# for again and its resend overwrites those bytes.
#
# A sink whose ``flush()`` is cheap and never blocks may say so with
# ``flush_on_loop = True``: the receiver then calls it on the event loop, so
# that COMPLETE leaves with the reply to the last chunk, without a hop to a
# worker thread.  Without it, flush() runs in a worker thread.


_SOURCE_ATTRS = ("nbytes", "itemsize", "layout_hash", "token_range", "layer_range", "read_into")
_SINK_ATTRS = ("nbytes", "layout_hash", "token_range", "layer_range", "write", "flush")


def is_source(obj: object) -> bool:
    """``isinstance(obj, Source)`` without the protocol check's cost (tens
    of microseconds on each call, on the path of every small transfer)."""
    return all(hasattr(obj, a) for a in _SOURCE_ATTRS)


def is_sink(obj: object) -> bool:
    """``isinstance(obj, Sink)``, cheaply (see :func:`is_source`)."""
    return all(hasattr(obj, a) for a in _SINK_ATTRS)


def _check(offset: int, n: int, total: int) -> None:
    if offset < 0 or n < 0 or offset + n > total:
        raise BufferTooSmall(f"slice [{offset}, {offset + n}) outside a {total}-byte transfer")


class BytesSource:
    """A source over an in-memory buffer (bytes, bytearray, numpy array...)."""

    def __init__(
        self,
        data: Any,
        *,
        itemsize: int = 1,
        layout_hash: int = 0,
        token_range: tuple[int, int] = (0, 0),
        layer_range: tuple[int, int] = (0, 0),
    ) -> None:
        self._mv = memoryview(data).cast("B")
        self._np = np.frombuffer(self._mv, np.uint8)
        self.nbytes = len(self._mv)
        self.itemsize = itemsize
        self.layout_hash = layout_hash
        self.token_range = token_range
        self.layer_range = layer_range

    def read_into(self, offset: int, out: memoryview) -> None:
        _check(offset, len(out), self.nbytes)
        np.copyto(np.frombuffer(out, np.uint8), self._np[offset : offset + len(out)])

    def view(self, offset: int, n: int) -> memoryview:
        """The bytes themselves, without a copy (the transport uses this when a
        source has it; they must stay unchanged until the transfer completes)."""
        _check(offset, n, self.nbytes)
        return self._mv[offset : offset + n]


class BytesSink:
    """A sink that fills a preallocated bytearray (``.data``)."""

    flush_on_loop = True  # flush() only records that it was called

    def __init__(
        self,
        nbytes: int,
        *,
        layout_hash: int = 0,
        token_range: tuple[int, int] = (0, 0),
        layer_range: tuple[int, int] = (0, 0),
    ) -> None:
        self.data = bytearray(nbytes)
        self._np = np.frombuffer(self.data, np.uint8)
        self.nbytes = nbytes
        self.layout_hash = layout_hash
        self.token_range = token_range
        self.layer_range = layer_range
        self.writes = 0
        self.flushed = False

    def write(self, offset: int, data: memoryview) -> None:
        _check(offset, len(data), self.nbytes)
        np.copyto(self._np[offset : offset + len(data)], np.frombuffer(data, np.uint8))
        self.writes += 1

    def view(self, offset: int, n: int) -> memoryview:
        """The destination bytes themselves (the receiver reads into them)."""
        _check(offset, n, self.nbytes)
        self.writes += 1
        return memoryview(self.data)[offset : offset + n]

    def flush(self) -> None:
        self.flushed = True


class _KVBase:
    """The wire bytes of one :class:`~kvbridge.span.KVSpan` of a cache (or
    of the five values it stands for: ``block_table, start, end, layers,
    heads``), checked once."""

    def __init__(
        self,
        cache: Any,
        block_table: Any,
        start: int | None = None,
        end: int | None = None,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
        *,
        num_threads: int = 1,
    ) -> None:
        from ... import pack as _pack  # the C++ core, loaded with the first KV source

        self._pack: Any = _pack
        span = as_span(block_table, start, end, layers, heads, what=type(self).__name__)
        if num_threads < 0:
            raise InvalidArgument(f"num_threads must be >= 0, got {num_threads}")
        # threads of one pack or unpack call (0: the core's own choice); the
        # transport already works on one chunk per worker thread, so one
        # thread per chunk keeps the cores from being oversubscribed
        self.num_threads = num_threads
        self.cache = cache
        layout = cache.layout
        # Checked once per transfer (the span's table, copied once, handed on);
        # each chunk checks only its slice.  LayoutError outside the cache's
        # layers or heads.
        self.range = cache.range(span, writable=isinstance(self, KVSink))
        self.span: KVSpan = self.range.span
        self.block_table = span.block_table
        self.start, self.end = span.start, span.end
        l0, l1 = self.layers = self.range.layers
        self.heads = self.range.heads
        self.nbytes = int(self.range.nbytes)
        self.itemsize = layout.itemsize
        # binds the head range: an OPEN of other heads is refused (protocol.md 7)
        self.layout_hash = layout.transfer_hash(self.heads)
        self.token_range = (self.start, self.end)
        self.layer_range = (l0, l1)
        # the pack core computes (checks) XXH3-64 in the copy on the CPU path
        self._one_pass = not getattr(cache, "is_cuda", False)


class KVSource(_KVBase):
    """The wire bytes of tokens ``[start, end)``, ``layers`` and ``heads`` (the
    model's KV heads ``[h0, h1)`` inside the cache's; default all it holds) of
    one request, packed from a :class:`kvbridge.pack.PagedKVCache` through its
    block table.  ``layout_hash`` is ``layout.transfer_hash(heads)``.  A CPU cache gives each raw chunk with its XXH3-64 from the pack's one
    pass (``read_checksummed``).  A CUDA cache packs into pinned host memory
    (the device-to-host copy is part of the pack kernel's output), and waits
    for it."""

    def __init__(self, *a: Any, zero_copy: bool = True, **kw: Any) -> None:
        super().__init__(*a, **kw)
        if self._one_pass:
            self.read_checksummed = self._read_checksummed
        self._runs = _memory_runs(self) if zero_copy and self._one_pass else None
        if self._runs is not None:
            self.views = self._views

    def _views(self, offset: int, n: int) -> list[memoryview]:
        """The runs of cache memory that hold the wire bytes ``[offset,
        offset + n)``, in wire order (no copy: views of the cache's arrays)."""
        _check(offset, n, self.nbytes)
        self._wait_ready(offset, n)
        assert self._runs is not None
        starts, lengths, bufs, mems, mvs = self._runs
        i = bisect.bisect_right(starts, offset) - 1
        out: list[memoryview] = []
        pos, end = offset, offset + n
        while pos < end:
            a = pos - starts[i]
            take = min(lengths[i] - a, end - pos)
            m = mems[i] + a
            out.append(mvs[bufs[i]][m : m + take])
            pos += take
            i += 1
        return out

    @property
    def read_on_loop(self) -> bool:
        """A CPU pack of a small chunk may run on the event loop; a CUDA one
        waits for its kernel and may not."""
        return not getattr(self.cache, "is_cuda", False)

    def _wait_ready(self, offset: int, n: int) -> None:
        """Called before the bytes ``[offset, offset + n)`` are packed: a
        subclass whose bytes become ready over time (layer-wise) waits here."""

    def _read_checksummed(self, offset: int, n: int) -> tuple[memoryview, int]:
        """A new buffer of the bytes ``[offset, offset + n)`` and their
        XXH3-64, from the pack core's one pass."""
        _check(offset, n, self.nbytes)
        self._wait_ready(offset, n)
        out = self._pack.aligned_empty(n)
        _, digest = self.range.pack(
            out, offset=offset, nbytes=n, checksum=True, num_threads=self.num_threads
        )
        return out.data, int(digest)

    def read(self, offset: int, n: int) -> memoryview:
        """A new buffer of the bytes ``[offset, offset + n)``: the pack core
        writes every byte, so it is not zero-filled first."""
        _check(offset, n, self.nbytes)
        if getattr(self.cache, "is_cuda", False):
            import torch

            stage = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            self._pack_to(stage, offset, n)
            torch.cuda.current_stream(torch.device(self.cache.device)).synchronize()
            return stage.numpy().data  # the array keeps the pinned tensor alive
        out: np.ndarray[Any, np.dtype[np.uint8]] = self._pack.aligned_empty(n)
        self._pack_to(out, offset, n)
        return out.data

    def read_into(self, offset: int, out: memoryview) -> None:
        _check(offset, len(out), self.nbytes)
        if getattr(self.cache, "is_cuda", False):
            np.frombuffer(out, dtype=np.uint8)[:] = self.read(offset, len(out))
            return
        self._pack_to(np.frombuffer(out, dtype=np.uint8), offset, len(out))

    def _pack_to(self, out: Any, offset: int, n: int) -> None:
        self._wait_ready(offset, n)
        self.range.pack(out, offset=offset, nbytes=n, num_threads=self.num_threads)


MIN_VIEW_RUN = 32 << 10  # a source lends its pages when its runs average at least this


def _host_buffers(cache: Any) -> list[tuple[int, memoryview]] | None:
    """(address, bytes) of each array the cache's memory lives in: numpy
    arrays or CPU torch tensors, C-contiguous (None otherwise)."""
    out = []
    for a in cache.layer_views():
        if isinstance(a, np.ndarray):
            arr = a
        else:
            try:
                import torch
            except ImportError:
                return None
            if not isinstance(a, torch.Tensor) or a.device.type != "cpu" or not a.is_contiguous():
                return None
            arr = a.detach().reshape(-1).view(torch.uint8).numpy()
        if not arr.flags.c_contiguous:
            return None
        out.append((int(arr.__array_interface__["data"][0]), arr.reshape(-1).view(np.uint8).data))
    return out


def _memory_runs(src: _KVBase) -> Any:
    """Where ``src``'s wire bytes sit in the cache's memory, as runs in wire
    order (wire ``[layer][component][token][head][head_dim]``): per run its
    wire offset, length, buffer and offset in that buffer (Python lists, for
    the per-chunk lookups), and the buffers.  None when a token's heads are
    not contiguous in memory, when the runs average under ``MIN_VIEW_RUN``
    bytes (packing them is then cheaper), or for memory other than host
    arrays."""
    cache = src.cache
    if getattr(cache, "is_cuda", False) or src.nbytes == 0:
        return None
    bufs = _host_buffers(cache)
    if not bufs:
        return None
    lay = cache.layout
    h0, h1 = src.heads
    hs, nh, hb = h0 - lay.head_start, h1 - h0, lay.head_bytes
    row = nh * hb  # one token of one layer and component on the wire
    pt, start, end = lay.page_tokens, src.start, src.end
    r, bt_tok = cache.block_ratio, cache.block_tokens
    table = np.asarray(src.block_table).reshape(-1).astype(np.int64)
    fb = start // bt_tok
    kernel = (table[fb : (end - 1) // bt_tok + 1, None] * r + np.arange(r)).reshape(-1)
    lps = np.arange(start // pt, (end - 1) // pt + 1, dtype=np.int64)
    phys = kernel[lps - fb * r]
    t0 = np.maximum(start - lps * pt, 0)
    t1 = np.minimum(end - lps * pt, pt)
    mem_parts, len_parts, buf_parts = [], [], []
    ptrs, strides = cache.component_ptrs, cache.strides
    order = sorted(range(len(bufs)), key=lambda k: bufs[k][0])
    addrs = [bufs[k][0] for k in order]
    for layer in range(*src.layers):
        for c in range(lay.num_components):
            s = strides[c]
            if s.elem != lay.itemsize or (nh > 1 and s.head != hb):
                return None  # a token's heads are not one contiguous row
            base = ptrs[layer][c] + hs * s.head
            if s.token == row:  # the tokens of a page are contiguous
                mem = base + phys * s.page + t0 * s.token
                ln = (t1 - t0) * row
            else:  # one run per token
                tok = np.arange(start, end, dtype=np.int64)
                mem = base + phys[tok // pt - lps[0]] * s.page + (tok % pt) * s.token
                ln = np.full(tok.size, row, dtype=np.int64)
            # the buffer that starts at or below the component's base (one
            # lookup, not a scan of every buffer per layer) must hold all its runs
            # (overlapping buffers may name another one: the source then packs)
            k = bisect.bisect_right(addrs, base) - 1
            if k < 0:
                return None
            i = order[k]
            off = mem - bufs[i][0]
            if int(off.min()) < 0 or int((off + ln).max()) > len(bufs[i][1]):
                return None
            mem_parts.append(off)
            len_parts.append(ln)
            buf_parts.append(np.full(off.size, i, dtype=np.int64))
    mem, ln, buf = (np.concatenate(x) for x in (mem_parts, len_parts, buf_parts))
    # coalesce neighbours that are adjacent in the same buffer
    head = np.ones(mem.size, dtype=bool)
    head[1:] = (buf[1:] != buf[:-1]) | (mem[1:] != mem[:-1] + ln[:-1])
    idx = np.flatnonzero(head)
    ln = np.add.reduceat(ln, idx)
    mem, buf = mem[idx], buf[idx]
    if src.nbytes / mem.size < MIN_VIEW_RUN:
        return None
    starts = np.concatenate(([0], np.cumsum(ln)[:-1]))
    return starts.tolist(), ln.tolist(), buf.tolist(), mem.tolist(), [mv for _, mv in bufs]


class KVSink(_KVBase):
    """Unpacks verified chunks straight into the destination pages (of
    ``heads``, as for :class:`KVSource`: the OPEN's layout hash must name the
    same head range).  A CPU
    cache checks a raw chunk's XXH3-64 in the pass that unpacks it
    (``write_checksummed``).  A CUDA cache unpacks from a pinned staging
    copy and waits for the kernel."""

    flush_on_loop = True  # every write already waited for its kernel: flush() is a no-op

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        if self._one_pass:
            self.write_checksummed = self._write_checksummed

    def _write_checksummed(self, offset: int, data: memoryview, checksum: int) -> None:
        """Unpack ``data`` at ``offset``, checking in the same pass that it
        hashes to ``checksum`` (ChecksumError: the slice's pages then hold
        unspecified bytes until the chunk's resend is unpacked there)."""
        _check(offset, len(data), self.nbytes)
        self.range.unpack(
            np.frombuffer(data, dtype=np.uint8),
            offset=offset,
            expect_checksum=checksum,
            num_threads=self.num_threads,
        )

    def write(self, offset: int, data: memoryview) -> None:
        _check(offset, len(data), self.nbytes)
        src: Any = np.frombuffer(data, dtype=np.uint8)
        cuda = getattr(self.cache, "is_cuda", False)
        if cuda:
            import torch

            stage = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
            stage.numpy()[:] = src
            src = stage
        self.range.unpack(src, offset=offset, num_threads=self.num_threads)
        if cuda:
            torch.cuda.current_stream(torch.device(self.cache.device)).synchronize()

    def flush(self) -> None:
        """Every write already waited for its kernel: nothing is pending."""
