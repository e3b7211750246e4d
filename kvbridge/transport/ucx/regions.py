"""The registered memory of a UCX agent: the cache tensors (one per layer, or
one stacked) and a staging buffer, each registered once as one region, and
the regions' descriptions that go into the agent's metadata."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import DTypeError, KVBridgeError, ShapeError, ucs_error
from ...layout import KVLayout, MemoryOrder
from .metadata import RegionInfo, RegionKind

__all__ = ["Registration", "buffer_of", "cache_tensors", "map_engine_error", "strided_spans"]


def map_engine_error(exc: BaseException, what: str) -> KVBridgeError:
    """A typed error for an exception raised by the compiled engine
    (``kvbridge._ucx.UcsError`` carries ``(status, text)``)."""
    if isinstance(exc, KVBridgeError):
        return exc
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) == 2 and isinstance(args[0], int):
        return ucs_error(args[0], f"{what}: {args[1]}")
    return KVBridgeError(f"{what}: {exc}")


class Registration:
    """The cache tensors and the staging buffer of one agent, registered with
    its engine (``ucp_mem_map``) once, at construction."""

    def __init__(self, engine: Any, layout: KVLayout, cache: Any, staging_bytes: int) -> None:
        self.tensors, self.num_pages = cache_tensors(layout, cache)
        spans = (
            strided_spans(cache)
            if layout.order is MemoryOrder.STRIDED
            else [buffer_of(t)[:2] for t in self.tensors]
        )
        regions: list[RegionInfo] = []
        ids: list[int] = []
        self.staging: np.ndarray | None = None
        self.staging_id = 0
        try:
            for layer, (addr, nbytes) in enumerate(spans):
                rid = engine.register_region(addr, nbytes)
                ids.append(rid)
                kind_layer = 0 if layout.stacked else layer
                regions.append(
                    RegionInfo(RegionKind.CACHE, kind_layer, addr, nbytes, engine.rkey(rid))
                )
            if staging_bytes > 0:
                self.staging = np.zeros(int(staging_bytes), dtype=np.uint8)
                addr = self.staging.ctypes.data
                self.staging_id = engine.register_region(addr, self.staging.nbytes)
                regions.append(
                    RegionInfo(
                        RegionKind.STAGING,
                        0,
                        addr,
                        self.staging.nbytes,
                        engine.rkey(self.staging_id),
                    )
                )
        except KVBridgeError:
            raise
        except Exception as e:
            raise map_engine_error(e, "UCX memory registration") from None
        self.cache_ids = np.array(ids, dtype=np.int64)
        self.regions = tuple(regions)


def buffer_of(t: Any) -> tuple[int, int, tuple[int, ...], int]:
    """(address, nbytes, shape, itemsize) of a C-contiguous numpy array or
    torch tensor, without copying."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):  # torch
        if not t.is_contiguous():
            raise ShapeError("cache tensors must be contiguous")
        return (
            int(t.data_ptr()),
            int(t.numel() * t.element_size()),
            tuple(t.shape),
            int(t.element_size()),
        )
    if hasattr(t, "ctypes") and hasattr(t, "flags"):  # numpy
        if not t.flags["C_CONTIGUOUS"]:
            raise ShapeError("cache arrays must be C-contiguous")
        if not t.flags["WRITEABLE"]:
            raise ShapeError("cache arrays must be writeable")
        return int(t.ctypes.data), int(t.nbytes), tuple(t.shape), int(t.itemsize)
    raise ShapeError(f"not a numpy array or torch tensor: {type(t).__name__}")


def strided_spans(cache: Any) -> list[tuple[int, int]]:
    """(address, nbytes) of the memory each layer of a strided cache (an
    engine's own views, ``PagedKVCache.from_vllm`` and the like) touches:
    from its lowest component base to the end of its farthest element."""
    lay = cache.layout
    spans = []
    for ptrs in cache.component_ptrs:
        lo, hi = min(ptrs), min(ptrs)
        for c, base in enumerate(ptrs):
            s = cache.strides[c]
            end = base + lay.itemsize
            if cache.num_pages:
                end += (
                    (cache.num_pages - 1) * s.page
                    + (lay.page_tokens - 1) * s.token
                    + (lay.num_kv_heads - 1) * s.head
                    + (lay.head_dim - 1) * s.elem
                )
            hi = max(hi, end)
        spans.append((int(lo), int(hi - lo)))
    return spans


def cache_tensors(layout: KVLayout, cache: Any) -> tuple[list[Any], int]:
    """The tensors of a cache (a PagedKVCache, a list of per-layer tensors,
    or one stacked tensor) and its page count, checked against ``layout``.
    A strided cache (an engine's own views) must be a PagedKVCache with this
    layout: its views are not contiguous, the cache holds their strides."""
    tensors: Sequence[Any]
    if layout.order is MemoryOrder.STRIDED:
        if getattr(cache, "layout", None) != layout or not hasattr(cache, "component_ptrs"):
            raise ShapeError(
                "a strided layout's cache must be the PagedKVCache it came from "
                "(PagedKVCache.from_vllm / from_sglang / from_strided)"
            )
        return list(cache.layer_views()), int(cache.num_pages)
    if hasattr(cache, "tensors"):
        tensors = list(cache.tensors)
    elif isinstance(cache, (list, tuple)):
        tensors = list(cache)
    else:
        tensors = [cache]
    want = 1 if layout.stacked else layout.num_layers
    if len(tensors) != want:
        raise ShapeError(f"layout needs {want} cache tensor(s), got {len(tensors)}")
    _, _, shape, itemsize = buffer_of(tensors[0])
    if itemsize != layout.itemsize:
        raise DTypeError(
            f"cache itemsize {itemsize}, layout {layout.dtype.value} needs {layout.itemsize}"
        )
    inner = shape[1:] if layout.stacked else shape
    if not inner:
        raise ShapeError(f"cache tensor shape {shape} is not a paged KV cache")
    page_axis = 0 if (layout.mla or layout.order is MemoryOrder.PAGE_FIRST) else 1
    if len(inner) <= page_axis:
        raise ShapeError(f"cache tensor shape {shape} is not a paged KV cache")
    num_pages = int(inner[page_axis])
    expect = layout.cache_shape(num_pages) if layout.stacked else layout.layer_shape(num_pages)
    for t in tensors:
        _, _, s, isz = buffer_of(t)
        if s != expect or isz != layout.itemsize:
            raise ShapeError(f"cache tensor shape {s} does not match the layout's {expect}")
    return tensors, num_pages
