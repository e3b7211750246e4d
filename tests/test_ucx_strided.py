"""UCX agents over engines' own strided caches (vLLM's per-layer views of one
flat buffer, described by ``PagedKVCache.from_vllm``): the metadata names
the layout as strided, pages move by the staging path only, and the tokens
land where vLLM's CPU attention reads them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from ucx_cases import agent as ucx_agent

from kvbridge.errors import PageIndexError, ShapeError
from kvbridge.layout import MemoryOrder
from kvbridge.transport import ucx
from kvbridge.transport.ucx.metadata import check_layouts, decode_metadata

torch = pytest.importorskip("torch")
pack = pytest.importorskip("kvbridge.pack")
if not pack.HAS_CORE:
    pytest.skip("the pack core is not built", allow_module_level=True)

from kvbridge.testing.engine_caches import read_vllm, vllm_kv_caches, write_vllm  # noqa: E402

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"),
]

LAYERS, HEADS, HEAD = 3, 2, 16


def run(fn: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(fn(), timeout)

    asyncio.run(main())


def cache(block: int, blocks: int) -> tuple[list[torch.Tensor], pack.PagedKVCache]:
    views = vllm_kv_caches(
        num_layers=LAYERS,
        num_blocks=blocks,
        num_kv_heads=HEADS,
        block_size=block,
        head_size=HEAD,
        dtype=torch.bfloat16,
        layout="LBHNC",
    )
    return views, pack.PagedKVCache.from_vllm(
        views, kv_split="cpu", block_tokens=block, cpu_isa="vec" if block % 32 == 0 else "vec16"
    )


def slots(table: np.ndarray, block: int, start: int, end: int) -> torch.Tensor:
    pos = np.arange(start, end)
    return torch.from_numpy(table[pos // block] * block + pos % block)


def test_vllm_views_move_by_staging_into_other_block_sizes() -> None:
    async def body() -> None:
        sv, sc = cache(16, 24)
        dv, dc = cache(32, 12)
        start, end = 5, 150
        sbt = np.random.default_rng(1).permutation(24)[:10]
        dbt = np.random.default_rng(2).permutation(12)[:5]
        g = torch.Generator().manual_seed(0)
        k = torch.randn(LAYERS, end - start, HEADS, HEAD, generator=g).to(torch.bfloat16)
        v = torch.randn(LAYERS, end - start, HEADS, HEAD, generator=g).to(torch.bfloat16)
        write_vllm(sv, slots(sbt, 16, start, end), k, v, kv_split="cpu")
        a = ucx_agent(sc.layout, sc, packer=pack, staging_bytes=1 << 16)
        b = ucx_agent(dc.layout, dc, packer=pack, staging_bytes=1 << 16)
        md = decode_metadata(b.metadata())
        assert md.layout.order is MemoryOrder.STRIDED
        assert not check_layouts(sc.layout, md.layout)
        assert len(md.cache_regions()) == LAYERS
        with pytest.raises(PageIndexError):
            b.expect("bad", np.array([0, 1, 99]), 0, 90)
        peer = await a.connect(b.metadata())
        assert not peer.same_layout
        he = b.expect("r", dbt, start, end)
        st = await peer.send("r", sbt, dbt, start, end)
        rt = await he
        assert st.path == rt.path == "staging"
        assert rt.bytes == sc.layout.wire_nbytes(end - start)
        gk, gv = read_vllm(dv, slots(dbt, 32, start, end), HEAD, kv_split="cpu")
        assert gv is not None
        assert torch.equal(gk, k) and torch.equal(gv, v)
        # the tokens before the range were not touched
        before = read_vllm(dv, slots(dbt, 32, 0, start), HEAD, kv_split="cpu")[0]
        assert not torch.any(before)
        await a.close()
        await b.close()

    run(body)


def test_a_strided_layout_needs_its_cache() -> None:
    views, c = cache(16, 8)
    with pytest.raises(ShapeError, match="PagedKVCache"):
        ucx_agent(c.layout, views, packer=pack)
