"""Reference pack/unpack in plain torch indexing: slow, obviously right, and
the yardstick that tests compare the C++/CUDA core against.

Everything is done on bytes: each component of each layer is viewed as a uint8
tensor ``[pages, page_tokens, heads, head_dim, itemsize]`` over the cache's
memory (:meth:`PagedKVCache.component_view`), so every dtype, memory order,
vLLM and SGLang arrangement goes the same way.  Block tables are in
``cache.block_tokens`` units, mapped to kernel pages here as the docs say.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..pack import PagedKVCache

__all__ = ["ref_pack", "ref_slots", "ref_unpack"]


def _as_torch(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


def ref_slots(cache: PagedKVCache, block_table: Any, start: int, end: int) -> tuple[Any, Any]:
    """(kernel page, slot) of every token of ``[start, end)``: token ``t`` is in
    block-table entry ``t // block_tokens``, whose kernel pages are
    ``entry * r .. entry * r + r - 1`` (``r = block_ratio``)."""
    bt = _as_torch(block_table).to(torch.int64).cpu()
    tokens = torch.arange(start, end, dtype=torch.int64)
    pt, btk, r = cache.layout.page_tokens, cache.block_tokens, cache.block_ratio
    pages = bt[tokens // btk] * r + (tokens % btk) // pt
    return pages, tokens % pt


def _heads(cache: PagedKVCache, heads: tuple[int, int] | None) -> slice:
    h0, h1 = cache.layout.check_heads(heads)
    c0 = cache.layout.head_start
    return slice(h0 - c0, h1 - c0)


def ref_pack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    layers: tuple[int, int] | None = None,
    heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The wire bytes of tokens ``[start, end)``, ``layers`` and ``heads`` (a CPU
    uint8 tensor)."""
    lay = cache.layout
    l0, l1 = lay.layer_range(layers)
    hs = _heads(cache, heads)
    pages, slots = ref_slots(cache, block_table, start, end)
    parts = []
    for layer in range(l0, l1):
        comps = []
        for c in range(lay.num_components):
            v = cache.component_view(layer, c)
            sel = v[pages.to(v.device), slots.to(v.device)][:, hs]  # [T, H', D, itemsize]
            comps.append(sel.reshape(end - start, sel[0].numel() if len(sel) else 0).cpu())
        parts.append(torch.stack(comps))  # [C, T, H' * head_bytes]
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
    heads: tuple[int, int] | None = None,
) -> None:
    """Write the full wire buffer of ``[start, end)``, ``layers`` and ``heads``
    into the cache."""
    lay = cache.layout
    l0, l1 = lay.layer_range(layers)
    hs = _heads(cache, heads)
    nh = hs.stop - hs.start
    pages, slots = ref_slots(cache, block_table, start, end)
    w = _as_torch(wire).reshape(-1).view(torch.uint8).cpu()
    shape = (l1 - l0, lay.num_components, end - start, nh, lay.head_dim, lay.itemsize)
    w = w[: int(np.prod(shape))].reshape(shape)
    for i, layer in enumerate(range(l0, l1)):
        for c in range(lay.num_components):
            v = cache.component_view(layer, c)
            v[pages.to(v.device), slots.to(v.device), hs] = w[i, c].to(v.device)
