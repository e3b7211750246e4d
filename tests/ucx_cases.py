"""Shared helpers of the UCX tests: layouts, caches and a byte-exact check."""

from __future__ import annotations

from typing import Any

import numpy as np
import ucx_refpack as ref

from kvbridge.layout import KVLayout

# The pre-shared key of the test agents: UCX agents take only authenticated
# peers by default.
TEST_PSK = b"kvbridge ucx test key, 32 bytes."


def agent(*args: Any, **kw: Any) -> Any:
    """A real UcxAgent holding TEST_PSK (unless told otherwise)."""
    from kvbridge.transport.ucx import UcxAgent

    kw.setdefault("psk", TEST_PSK)
    return UcxAgent(*args, **kw)


def make_cache(layout: KVLayout, num_pages: int, seed: int | None) -> list[np.ndarray]:
    """Random (seed) or zero cache tensors, 16-bit elements viewed as uint16."""
    rng = np.random.default_rng(seed)
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32}[layout.itemsize]
    shapes = (
        [layout.cache_shape(num_pages)]
        if layout.stacked
        else [layout.layer_shape(num_pages)] * layout.num_layers
    )
    if seed is None:
        return [np.zeros(s, dtype=dt) for s in shapes]
    return [rng.integers(1, np.iinfo(dt).max, size=s, dtype=dt) for s in shapes]


def same_tokens(
    a_layout: KVLayout,
    a: Any,
    a_bt: Any,
    b_layout: KVLayout,
    b: Any,
    b_bt: Any,
    start: int,
    end: int,
    layers: Any = None,
) -> bool:
    wa = ref.wire(ref.PagedKVCache(a_layout, a), a_bt, start, end, layers)
    wb = ref.wire(ref.PagedKVCache(b_layout, b), b_bt, start, end, layers)
    return bool(np.array_equal(wa, wb))


SMALL = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, page_tokens=8, name="small")
