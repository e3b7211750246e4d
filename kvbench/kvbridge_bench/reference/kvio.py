"""Torch reference of the pack core: move a token range of a paged KV cache
to and from the canonical wire layout through a block table.

``kvbridge.pack`` does the same with the C++/CUDA core; these functions are
the readable reference the decoder and the tests use.  Standard attention
caches only (two components, K and V).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbridge.errors import LayoutError, PageIndexError, ShapeError
from kvbridge.layout import HeadOrder, KVLayout, MemoryOrder

__all__ = ["component_views", "gather_wire", "scatter_wire", "slot_index"]


def component_views(layout: KVLayout, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(K, V)`` of one layer's tensor, each ``[pages, page_tokens, heads, dim]``
    whatever the memory order (writes through the views land in the cache)."""
    if layout.mla:
        raise LayoutError("the reference decoder has no MLA attention")
    if layout.order is MemoryOrder.KV_FIRST:
        k, v = layer[0], layer[1]
    else:
        k, v = layer[:, 0], layer[:, 1]
    if layout.head_order is HeadOrder.HND:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def slot_index(
    layout: KVLayout, block_table: Sequence[int], start: int, end: int, num_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, slots in page) of the tokens ``[start, end)``."""
    pt = layout.page_tokens
    if not 0 <= start <= end or -(-end // pt) > len(block_table):
        raise PageIndexError(
            f"block table of {len(block_table)} pages does not cover tokens [{start}, {end})"
        )
    pos = torch.arange(start, end)
    table = torch.as_tensor(list(block_table), dtype=torch.long)
    pages = table[pos // pt] if end > start else torch.empty(0, dtype=torch.long)
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise PageIndexError(f"block table names a page outside [0, {num_pages})")
    return pages, pos % pt


def gather_wire(
    layout: KVLayout,
    caches: Sequence[torch.Tensor],
    block_table: Sequence[int],
    start: int,
    end: int,
) -> torch.Tensor:
    """The tokens ``[start, end)`` as a wire buffer ``[layers, 2, tokens, heads, dim]``."""
    if len(caches) != layout.num_layers:
        raise ShapeError(f"{len(caches)} layer tensors for {layout.num_layers} layers")
    num_pages = caches[0].shape[1 if layout.order is MemoryOrder.KV_FIRST else 0]
    pages, slots = slot_index(layout, block_table, start, end, num_pages)
    out = []
    for layer in caches:
        k, v = component_views(layout, layer)
        out.append(torch.stack([k[pages, slots], v[pages, slots]]))
    return torch.stack(out)


def scatter_wire(
    layout: KVLayout,
    caches: Sequence[torch.Tensor],
    block_table: Sequence[int],
    start: int,
    wire: torch.Tensor,
) -> None:
    """Write a wire buffer for the tokens ``[start, start + n)`` into the pages."""
    n = wire.shape[2] if wire.dim() == 5 else -1
    want = layout.wire_shape(max(n, 0))
    if tuple(wire.shape) != want:
        raise ShapeError(f"wire buffer of shape {tuple(wire.shape)}, expected {want}")
    if len(caches) != layout.num_layers:
        raise ShapeError(f"{len(caches)} layer tensors for {layout.num_layers} layers")
    num_pages = caches[0].shape[1 if layout.order is MemoryOrder.KV_FIRST else 0]
    pages, slots = slot_index(layout, block_table, start, start + n, num_pages)
    for i, layer in enumerate(caches):
        k, v = component_views(layout, layer)
        k[pages, slots] = wire[i, 0].to(k.dtype)
        v[pages, slots] = wire[i, 1].to(v.dtype)
