"""Reference pack/unpack in plain torch indexing: slow, obviously right, and
the yardstick that tests compare the C++/CUDA core against.

Everything is done on bytes (each head's ``head_dim`` elements viewed as
``head_bytes`` uint8), so every dtype, bf16 and fp8 included, goes the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..layout import HeadOrder, KVLayout, MemoryOrder
from ..pack import PagedKVCache

__all__ = ["canonical_layer_view", "ref_pack", "ref_unpack"]


def _as_torch(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


def canonical_layer_view(layout: KVLayout, layer: Any) -> torch.Tensor:
    """A uint8 view ``[components, pages, page_tokens, heads, head_bytes]`` of one
    layer's array (numpy or torch; shares its memory)."""
    t = _as_torch(layer)
    u8 = t.view(torch.uint8) if t.dim() > 0 else t
    if layout.mla:  # [P, pt, hb]
        return u8.unsqueeze(0).unsqueeze(3)
    hnd = layout.head_order is HeadOrder.HND
    if layout.order is MemoryOrder.KV_FIRST:  # [2, P, pt, H, hb] or [2, P, H, pt, hb]
        return u8.permute(0, 1, 3, 2, 4) if hnd else u8
    # [P, 2, pt, H, hb] or [P, 2, H, pt, hb]
    return u8.permute(1, 0, 3, 2, 4) if hnd else u8.permute(1, 0, 2, 3, 4)


def _indices(layout: KVLayout, block_table: Any, start: int, end: int) -> tuple[Any, Any]:
    bt = _as_torch(block_table).to(torch.int64).cpu()
    tokens = torch.arange(start, end, dtype=torch.int64)
    return bt[tokens // layout.page_tokens], tokens % layout.page_tokens


def ref_pack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    layers: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The wire bytes of tokens ``[start, end)`` and ``layers`` (a CPU uint8 tensor)."""
    lay = cache.layout
    l0, l1 = lay.layer_range(layers)
    pages, slots = _indices(lay, block_table, start, end)
    parts = []
    for view in cache.layer_views()[l0:l1]:
        v = canonical_layer_view(lay, view)
        parts.append(v[:, pages.to(v.device), slots.to(v.device)].cpu())  # [C, T, H, hb]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.stack(parts).reshape(-1)


def ref_unpack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    wire: Any,
    layers: tuple[int, int] | None = None,
) -> None:
    """Write the full wire buffer of ``[start, end)`` and ``layers`` into the cache."""
    lay = cache.layout
    l0, l1 = lay.layer_range(layers)
    pages, slots = _indices(lay, block_table, start, end)
    w = _as_torch(wire).reshape(-1).view(torch.uint8).cpu()
    shape = (l1 - l0, lay.num_components, end - start, lay.num_kv_heads, lay.head_bytes)
    w = w[: int(np.prod(shape))].reshape(shape)
    for i, view in enumerate(cache.layer_views()[l0:l1]):
        v = canonical_layer_view(lay, view)
        v[:, pages.to(v.device), slots.to(v.device)] = w[i].to(v.device)
