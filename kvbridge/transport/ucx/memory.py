"""The registered memory of a UCX agent: the cache tensors (one per layer, or
one stacked) and a staging buffer, each registered once as one region."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import DTypeError, ShapeError
from ...layout import KVLayout, MemoryOrder

__all__ = ["buffer_of", "cache_tensors"]


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


def cache_tensors(layout: KVLayout, cache: Any) -> tuple[list[Any], int]:
    """The tensors of a cache (a PagedKVCache, a list of per-layer tensors,
    or one stacked tensor) and its page count, checked against ``layout``."""
    tensors: Sequence[Any]
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
