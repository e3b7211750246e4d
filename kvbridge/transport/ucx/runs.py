"""Contiguous byte runs of a page transfer between two caches with the same
memory layout (sans-IO, numpy).

A token range ``[start, end)`` of layers ``[l0, l1)`` is cut into elementary
pieces (one per layer, K/V component and page; per head too for HND pages
that are only partly covered), walked in memory order of the layout, and
adjacent pieces that are contiguous at both ends are merged: a request whose
block tables are runs of consecutive pages becomes a handful of puts instead of
``layers x 2 x pages`` descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import LayoutError, PageIndexError
from ...layout import HeadOrder, KVLayout, MemoryOrder

__all__ = [
    "CacheGeometry",
    "as_table",
    "check_table",
    "coalesce",
    "page_pieces",
    "plan_args",
    "put_runs",
]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class CacheGeometry:
    """Where each layer of a cache lives: region ``layer`` at offset 0 (one
    tensor per layer), or region 0 at ``layer * layer_bytes`` (stacked)."""

    layout: KVLayout
    num_pages: int

    @property
    def layer_bytes(self) -> int:
        return self.layout.layer_numel(self.num_pages) * self.layout.itemsize

    @property
    def num_regions(self) -> int:
        return 1 if self.layout.stacked else self.layout.num_layers


def as_table(block_table: Any) -> I64:
    """A block table as a flat C-contiguous int64 array (the same array when
    it already is one)."""
    t = np.ascontiguousarray(block_table, dtype=np.int64)
    return t if t.ndim == 1 else t.reshape(-1)


def check_table(geom: CacheGeometry, block_table: I64, start: int, end: int) -> None:
    """Raise PageIndexError unless ``block_table`` covers tokens ``[start,
    end)`` with pages of the cache (what :func:`page_pieces` checks, without
    computing the pieces: a receive's check costs microseconds)."""
    if start >= end:
        return
    pt = geom.layout.page_tokens
    first, last = start // pt, (end - 1) // pt
    if block_table.size <= last:
        raise PageIndexError(
            f"block table of {block_table.size} pages does not cover tokens [{start}, {end})"
        )
    if last == first:
        page = int(block_table[first])
        bad = not 0 <= page < geom.num_pages
    else:
        phys = block_table[first : last + 1]
        bad = bool(phys.min() < 0 or phys.max() >= geom.num_pages)
    if bad:
        raise PageIndexError(f"block table names a page outside [0, {geom.num_pages})")


def page_pieces(
    geom: CacheGeometry,
    block_table: npt.ArrayLike,
    start: int,
    end: int,
    layers: tuple[int, int] | None = None,
) -> tuple[I64, I64, I64]:
    """(region, byte offset, length) of every elementary piece, in memory order."""
    lay = geom.layout
    l0, l1 = lay.layer_range(layers)
    if not 0 <= start <= end:
        raise LayoutError(f"bad token range [{start}, {end})")
    empty = np.zeros(0, dtype=np.int64)
    if start == end or l0 == l1:
        return empty, empty, empty
    pt = lay.page_tokens
    first, last = start // pt, (end - 1) // pt
    bt = np.asarray(block_table, dtype=np.int64).reshape(-1)
    check_table(geom, bt, start, end)
    phys = bt[first : last + 1]
    logical = np.arange(first, last + 1, dtype=np.int64)
    t0 = np.maximum(start - logical * pt, 0)
    t1 = np.minimum(end - logical * pt, pt)

    s_comp, s_page, s_tok, s_head = lay.byte_strides(geom.num_pages)
    nlay = np.arange(l0, l1, dtype=np.int64)
    comps = np.arange(lay.num_components, dtype=np.int64)
    if lay.head_order is HeadOrder.HND and not lay.mla:
        heads = np.arange(lay.num_kv_heads, dtype=np.int64)
        unit = lay.head_bytes
    else:
        heads = np.zeros(1, dtype=np.int64)
        unit = s_tok
    if lay.stacked:
        region = np.zeros_like(nlay)
        layer_base = nlay * geom.layer_bytes
    else:
        region, layer_base = nlay, np.zeros_like(nlay)

    # axes: layer, then (comp, page) or (page, comp) in memory order, then head
    Axes = tuple[slice | None, ...]
    L: Axes = (slice(None), None, None, None)
    C: Axes
    P: Axes
    if lay.order is MemoryOrder.KV_FIRST:
        C, P = (None, slice(None), None, None), (None, None, slice(None), None)
    else:
        P, C = (None, slice(None), None, None), (None, None, slice(None), None)
    H: Axes = (None, None, None, slice(None))
    off = layer_base[L] + comps[C] * s_comp + phys[P] * s_page + heads[H] * s_head + t0[P] * unit
    length = ((t1 - t0)[P] * unit) + np.zeros_like(off)
    reg = region[L] + np.zeros_like(off)
    return reg.reshape(-1), off.reshape(-1), length.reshape(-1)


def coalesce(
    src_reg: I64, src_off: I64, dst_reg: I64, dst_off: I64, length: I64
) -> tuple[I64, I64, I64, I64, I64]:
    """Merge neighbouring pieces that are contiguous at both ends."""
    if length.size == 0:
        return src_reg, src_off, dst_reg, dst_off, length
    cont = (
        (src_reg[1:] == src_reg[:-1])
        & (dst_reg[1:] == dst_reg[:-1])
        & (src_off[1:] == src_off[:-1] + length[:-1])
        & (dst_off[1:] == dst_off[:-1] + length[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return (
        src_reg[starts],
        src_off[starts],
        dst_reg[starts],
        dst_off[starts],
        np.add.reduceat(length, starts),
    )


def put_runs(
    src: CacheGeometry,
    src_block_table: npt.ArrayLike,
    dst: CacheGeometry,
    dst_block_table: npt.ArrayLike,
    start: int,
    end: int,
    layers: tuple[int, int] | None,
    src_region_ids: npt.ArrayLike,
    dst_region_ids: npt.ArrayLike,
) -> U64:
    """The (local region id, local offset, remote region id, remote offset,
    length) rows of one transfer, coalesced; both caches must have the same
    memory layout (``exact_hash``), possibly with different page counts."""
    if src.layout.exact_hash != dst.layout.exact_hash:
        raise LayoutError("the put path needs two caches with the same memory layout")
    sreg, soff, slen = page_pieces(src, src_block_table, start, end, layers)
    dreg, doff, _ = page_pieces(dst, dst_block_table, start, end, layers)
    sreg, soff, dreg, doff, length = coalesce(sreg, soff, dreg, doff, slen)
    sid = np.asarray(src_region_ids, dtype=np.int64)
    did = np.asarray(dst_region_ids, dtype=np.int64)
    out = np.empty((length.size, 5), dtype=np.uint64)
    out[:, 0] = sid[sreg]
    out[:, 1] = soff
    out[:, 2] = did[dreg]
    out[:, 3] = doff
    out[:, 4] = length
    return out


def plan_args(
    src: CacheGeometry,
    dst: CacheGeometry,
    src_region_ids: npt.ArrayLike,
    dst_region_ids: npt.ArrayLike,
) -> dict[str, object]:
    """The keyword arguments of the compiled engine's ``RunPlan`` (its C++
    twin of :func:`put_runs`) for two caches with the same memory layout."""
    if src.layout.exact_hash != dst.layout.exact_hash:
        raise LayoutError("the put path needs two caches with the same memory layout")
    lay = src.layout

    def shape(g: CacheGeometry, ids: npt.ArrayLike) -> tuple[object, ...]:
        return (
            g.num_pages,
            g.layer_bytes,
            *lay.byte_strides(g.num_pages),
            [int(x) for x in np.asarray(ids).reshape(-1)],
        )

    return {
        "page_tokens": lay.page_tokens,
        "components": lay.num_components,
        "heads": lay.num_kv_heads,
        "head_bytes": lay.head_bytes,
        "hnd": lay.head_order is HeadOrder.HND and not lay.mla,
        "kv_first": lay.order is MemoryOrder.KV_FIRST,
        "stacked": lay.stacked,
        "num_layers": lay.num_layers,
        "src": shape(src, src_region_ids),
        "dst": shape(dst, dst_region_ids),
    }
