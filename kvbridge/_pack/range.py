"""KVRange: one transfer's range of a cache, checked once, that packs and
unpacks any byte slice of its wire buffer; and the one-call pack / unpack."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BufferTooSmall, InvalidArgument, Unavailable, raise_for_status
from ..layout import KVLayout
from ..span import KVSpan, as_span
from .cache import PagedKVCache
from .plumbing import (
    _as_bytes,
    _device_of,
    _index,
    _is_tensor,
    _nbytes,
    _new_buffer,
    _require_core,
    _slice,
    _stream,
    _threads,
    _token_range,
    _torch,
)


class KVRange:
    """One transfer's range of a cache, checked once: tokens ``[start, end)``,
    ``layers`` (default all), the model's KV heads ``heads`` (default all the
    cache holds) and the block table (in ``cache.block_tokens`` units), given
    as one :class:`~kvbridge.span.KVSpan` (``KVRange(cache, span)``) or as
    the five values (``KVRange(cache, block_table, start, end, layers=...,
    heads=...)``).  ``span`` is the range's span, its layers and heads
    resolved.

    ``writable=False`` makes a range that only packs, and that accepts a page
    named twice.  The block table is converted to int32 kernel pages and
    copied once (for a CUDA cache, staged to the device once); later changes to
    the caller's table do not affect the range.  Safe to use from several
    threads at once.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        block_table: Any,
        start: int | None = None,
        end: int | None = None,
        *,
        layers: tuple[int, int] | None = None,
        heads: tuple[int, int] | None = None,
        writable: bool = True,
    ) -> None:
        core = _require_core()
        a = _RangeArgs(cache, as_span(block_table, start, end, layers, heads, what="KVRange"))
        rc, msg, plan = core.make_plan(
            cache._desc, a.table, a.start, a.end, *a.layers, *a.core_heads, writable
        )
        raise_for_status(rc, msg)
        self._cache = cache
        self._plan = plan
        self.span = a.span
        self.start, self.end = a.start, a.end
        self.layers = a.layers
        self.heads = a.heads
        self.writable = bool(writable)
        self.nbytes: int = int(plan.nbytes)

    @property
    def cache(self) -> PagedKVCache:
        return self._cache

    @property
    def layout(self) -> KVLayout:
        return self._cache.layout

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def pack(
        self,
        out: Any = None,
        *,
        offset: int = 0,
        nbytes: int | None = None,
        num_threads: int = 0,
        stream: Any = None,
        checksum: bool = False,
    ) -> Any:
        """Gather bytes ``[offset, offset + nbytes)`` of the range's wire buffer
        into ``out``; return ``out`` (``(out, xxh3)`` with ``checksum=True``).

        With ``out=None`` a uint8 buffer of the cache's backend and device is
        allocated; otherwise the first ``nbytes`` bytes of ``out`` are written.
        ``nbytes`` defaults to the rest of the wire buffer.  ``checksum=True``
        (CPU caches) also computes the XXH3-64 (seed 0) of the bytes written,
        in the same pass (one thread copies the slice then).  CUDA caches run
        on ``stream`` (None: torch's current stream; an int handle or a torch
        stream).
        """
        core = _require_core()
        cache = self._cache
        off, n = _slice(self.nbytes, offset, nbytes)
        threads = _threads(num_threads)
        handle = _stream(cache, stream)
        if checksum and cache.is_cuda:
            raise Unavailable("the checksum in the copy is computed on the CPU path only")
        if out is None:
            out = _new_buffer(cache, n)
        view = _as_bytes(out, writable=True, cache=cache, what="out")
        if _nbytes(view) < n:
            raise BufferTooSmall(f"out holds {_nbytes(view)} bytes; the slice needs {n}")
        rc, msg, digest = core.plan_pack(self._plan, off, view, n, threads, handle, bool(checksum))
        raise_for_status(rc, msg)
        return (out, int(digest)) if checksum else out

    def unpack(
        self,
        src: Any,
        *,
        offset: int = 0,
        nbytes: int | None = None,
        num_threads: int = 0,
        stream: Any = None,
        expect_checksum: int | None = None,
    ) -> None:
        """Scatter ``src`` -- bytes ``[offset, offset + nbytes)`` of the range's
        wire buffer -- into the cache.

        ``nbytes`` defaults to all of ``src``: a chunk of the wire buffer is
        unpacked by passing it with its offset, in any order.  On an argument
        error nothing is written.  ``expect_checksum`` (CPU caches): the
        XXH3-64 the bytes must have, verified in the same pass; on a mismatch
        :class:`~kvbridge.errors.ChecksumError` is raised and the cache slots
        of exactly this slice hold unspecified bytes (nothing else was
        written): unpacking the right bytes into the slice again repairs them.
        """
        core = _require_core()
        cache = self._cache
        if not self.writable:
            raise InvalidArgument("this range was made with writable=False: it only packs")
        view = _as_bytes(src, writable=False, cache=cache, what="src")
        have = _nbytes(view)
        if nbytes is not None and _index(nbytes, "nbytes") > have:
            raise BufferTooSmall(f"src holds {have} bytes; nbytes={nbytes}")
        off, n = _slice(self.nbytes, offset, have if nbytes is None else nbytes)
        threads = _threads(num_threads)
        handle = _stream(cache, stream)
        expect = None
        if expect_checksum is not None:
            if cache.is_cuda:
                raise Unavailable("the checksum in the copy is verified on the CPU path only")
            expect = _index(expect_checksum, "expect_checksum")
            if not 0 <= expect < 2**64:
                raise InvalidArgument(f"expect_checksum {expect} is not a u64")
        rc, msg = core.plan_unpack(self._plan, off, view, n, threads, handle, expect)
        raise_for_status(rc, msg)

    def __repr__(self) -> str:
        return (
            f"KVRange(tokens [{self.start}, {self.end}), layers {list(self.layers)}, heads "
            f"{list(self.heads)}, {self.nbytes} wire bytes of {self._cache!r})"
        )


class _RangeArgs:
    """A range's arguments checked and converted for the core (head range
    relative to the cache's heads, 0, 0 for all; kernel-page int32 table)."""

    def __init__(self, cache: PagedKVCache, span: KVSpan) -> None:
        if not isinstance(cache, PagedKVCache):
            raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        lay = cache.layout
        self.span = span.resolve(lay)  # LayoutError outside the cache's layers or heads
        self.start, self.end = span.start, span.end
        assert self.span.layers is not None and self.span.heads is not None
        self.layers, self.heads = self.span.layers, self.span.heads
        h0, h1 = self.heads
        self.core_heads = (
            (0, 0) if self.heads == lay.head_range else (h0 - lay.head_start, h1 - lay.head_start)
        )
        # the span's int32 table as it is (the core copies what it keeps)
        self.table = cache._kernel_table(span.block_table, self.start, self.end)


def wire_nbytes(
    layout: KVLayout,
    start: int,
    end: int,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
) -> int:
    """Bytes of the wire buffer of tokens ``[start, end)``, a layer range and a
    head range (the model's heads, default all the layout's cache holds)."""
    s, e = _token_range(start, end)
    return layout.wire_nbytes(e - s, layers, heads)


def xxh3_64(data: Any) -> int:
    """XXH3-64 (seed 0) of a host buffer's bytes, computed by the pack core:
    equal to ``xxhash.xxh3_64_intdigest`` of the same bytes."""
    core = _require_core()
    arr: Any
    if isinstance(data, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(data, dtype=np.uint8)
    elif isinstance(data, np.ndarray):
        arr = data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else None
    elif _is_tensor(data) and _device_of(data) == "cpu" and data.is_contiguous():
        arr = data.detach().reshape(-1).view(_torch().uint8).numpy()
    else:
        arr = None
    if arr is None:
        raise InvalidArgument("xxh3_64 takes a contiguous host buffer")
    return int(core.xxh3_64(arr))


def pack(
    cache: PagedKVCache,
    block_table: Any,
    start: int | None = None,
    end: int | None = None,
    *,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
    out: Any = None,
    offset: int = 0,
    nbytes: int | None = None,
    num_threads: int = 0,
    stream: Any = None,
    checksum: bool = False,
) -> Any:
    """Gather bytes ``[offset, offset + nbytes)`` of the wire buffer of tokens
    ``[start, end)`` (and ``layers``, ``heads``, default all) into ``out``;
    return ``out`` (``(out, xxh3)`` with ``checksum=True``).

    One call checks the range and packs (``cache.range(...).pack(...)``): to
    pack a transfer in chunks, make its :class:`KVRange` once instead.
    ``block_table[i]`` is the block holding tokens ``[i*bt, (i+1)*bt)``
    (``bt = cache.block_tokens``); a :class:`~kvbridge.span.KVSpan` may
    stand for the five values (``pack(cache, span, out=...)``).  See
    :meth:`KVRange.pack` for the rest.
    """
    if not isinstance(cache, PagedKVCache):
        raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    span = as_span(block_table, start, end, layers, heads, what="pack()")
    if cache.is_cuda:  # one call: stage in stream order instead of making a plan
        return _once_cuda(
            True, cache, span, out, offset, nbytes, num_threads, stream, checksum
        )  # fmt: skip
    rng = KVRange(cache, span, writable=False)
    return rng.pack(
        out, offset=offset, nbytes=nbytes, num_threads=num_threads, stream=stream, checksum=checksum
    )


def unpack(
    cache: PagedKVCache,
    block_table: Any,
    start: Any = None,
    end: int | None = None,
    src: Any = None,
    *,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
    offset: int = 0,
    nbytes: int | None = None,
    num_threads: int = 0,
    stream: Any = None,
    expect_checksum: int | None = None,
) -> None:
    """Scatter ``src`` -- bytes ``[offset, offset + nbytes)`` of the wire buffer
    of tokens ``[start, end)`` (and ``layers``, ``heads``) -- into the cache.

    One call checks the range and unpacks (``cache.range(...).unpack(...)``).
    With a :class:`~kvbridge.span.KVSpan` for the five values, ``src`` comes
    third: ``unpack(cache, span, src)`` (or ``src=``).  See
    :meth:`KVRange.unpack`.
    """
    if not isinstance(cache, PagedKVCache):
        raise InvalidArgument(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if isinstance(block_table, KVSpan) and end is None and src is None and start is not None:
        start, src = None, start  # unpack(cache, span, src)
    if src is None:
        raise InvalidArgument("unpack() needs src, the wire bytes to scatter")
    span = as_span(block_table, start, end, layers, heads, what="unpack()")
    if cache.is_cuda:
        _once_cuda(
            False, cache, span, src, offset, nbytes, num_threads, stream,
            expect_checksum is not None,
        )  # fmt: skip
        return
    rng = KVRange(cache, span, writable=True)
    rng.unpack(
        src,
        offset=offset,
        nbytes=nbytes,
        num_threads=num_threads,
        stream=stream,
        expect_checksum=expect_checksum,
    )


def _once_cuda(
    packing: bool,
    cache: PagedKVCache,
    span: KVSpan,
    buf: Any,
    offset: int,
    nbytes: int | None,
    num_threads: int,
    stream: Any,
    checksum: bool,
) -> Any:
    """One pack or unpack of a CUDA cache through the per-call entry points,
    which stage the block table in stream order (a KVRange stages it once)."""
    core = _require_core()
    a = _RangeArgs(cache, span)
    total = cache.layout.wire_nbytes(a.end - a.start, a.layers, a.heads)
    if checksum:
        raise Unavailable("the checksum in the copy is computed on the CPU path only")
    threads = _threads(num_threads)
    if packing:
        off, n = _slice(total, offset, nbytes)
        handle = _stream(cache, stream)
        out = _new_buffer(cache, n) if buf is None else buf
        view = _as_bytes(out, writable=True, cache=cache, what="out")
        if _nbytes(view) < n:
            raise BufferTooSmall(f"out holds {_nbytes(view)} bytes; the slice needs {n}")
        rc, msg = core.pack(cache._desc, a.table, a.start, a.end, *a.layers, off, view, n,
                            threads, handle, *a.core_heads)  # fmt: skip
        raise_for_status(rc, msg)
        return out
    view = _as_bytes(buf, writable=False, cache=cache, what="src")
    have = _nbytes(view)
    if nbytes is not None and _index(nbytes, "nbytes") > have:
        raise BufferTooSmall(f"src holds {have} bytes; nbytes={nbytes}")
    off, n = _slice(total, offset, have if nbytes is None else nbytes)
    handle = _stream(cache, stream)
    rc, msg = core.unpack(cache._desc, a.table, a.start, a.end, *a.layers, off, view, n,
                          threads, handle, *a.core_heads)  # fmt: skip
    raise_for_status(rc, msg)
    return None
