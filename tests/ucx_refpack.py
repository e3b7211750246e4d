"""Test-only numpy reference of the pack API (kvbridge.pack signatures):
gathers and scatters tokens of a paged cache in the wire layout with fancy
indexing.  Used to verify integrity, and to drive the UCX staging path where
the pack core is not built; the real kvbridge.pack is used when present."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.layout import HeadOrder, KVLayout, MemoryOrder


class PagedKVCache:
    def __init__(self, layout: KVLayout, tensors: Any) -> None:
        self.layout = layout
        self.tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]

    def layer(self, layer: int) -> np.ndarray:
        return self.tensors[0][layer] if self.layout.stacked else self.tensors[layer]


def _index(layout: KVLayout, bt: Any, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    tok = np.arange(start, end)
    bt = np.asarray(bt, dtype=np.int64)
    return bt[tok // layout.page_tokens], tok % layout.page_tokens


def gather(cache: PagedKVCache, bt: Any, start: int, end: int, layer: int) -> np.ndarray:
    """[components, tokens, heads, dim] of one layer."""
    lay, t = cache.layout, cache.layer(layer)
    pg, off = _index(lay, bt, start, end)
    if lay.mla:
        return t[pg, off][None, :, None, :]
    kv_first, nhd = lay.order is MemoryOrder.KV_FIRST, lay.head_order is HeadOrder.NHD
    if kv_first and nhd:
        return t[:, pg, off]
    if kv_first:
        return t[:, pg, :, off].transpose(1, 0, 2, 3)
    if nhd:
        return t[pg, :, off].transpose(1, 0, 2, 3)
    return t[pg, :, :, off].transpose(1, 0, 2, 3)


def scatter(
    cache: PagedKVCache, bt: Any, start: int, end: int, layer: int, val: np.ndarray
) -> None:
    lay, t = cache.layout, cache.layer(layer)
    pg, off = _index(lay, bt, start, end)
    if lay.mla:
        t[pg, off] = val[0, :, 0, :]
        return
    kv_first, nhd = lay.order is MemoryOrder.KV_FIRST, lay.head_order is HeadOrder.NHD
    if kv_first and nhd:
        t[:, pg, off] = val
    elif kv_first:
        t[:, pg, :, off] = val.transpose(1, 0, 2, 3)
    elif nhd:
        t[pg, :, off] = val.transpose(1, 0, 2, 3)
    else:
        t[pg, :, :, off] = val.transpose(1, 0, 2, 3)


def wire(cache: PagedKVCache, bt: Any, start: int, end: int, layers: Any = None) -> np.ndarray:
    l0, l1 = cache.layout.layer_range(layers)
    parts = [
        np.ascontiguousarray(gather(cache, bt, start, end, layer)).view(np.uint8).reshape(-1)
        for layer in range(l0, l1)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def pack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    layers: Any = None,
    out: Any = None,
    offset: int = 0,
    nbytes: int | None = None,
) -> np.ndarray:
    w = wire(cache, block_table, start, end, layers)
    n = w.size - offset if nbytes is None else nbytes
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    out[:n] = w[offset : offset + n]
    return out


def unpack(
    cache: PagedKVCache,
    block_table: Any,
    start: int,
    end: int,
    src: Any,
    layers: Any = None,
    offset: int = 0,
) -> None:
    lay = cache.layout
    l0, l1 = lay.layer_range(layers)
    w = wire(cache, block_table, start, end, layers)
    src = np.asarray(src, dtype=np.uint8).reshape(-1)
    w[offset : offset + src.size] = src
    per = (end - start) * lay.token_bytes_per_layer
    dt = cache.layer(l0).dtype
    for i, layer in enumerate(range(l0, l1)):
        val = (
            w[i * per : (i + 1) * per]
            .view(dt)
            .reshape(lay.num_components, end - start, lay.num_kv_heads, lay.head_dim)
        )
        scatter(cache, block_table, start, end, layer, val)
