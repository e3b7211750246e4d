"""Validated ranges: vLLM's manager blocks over smaller kernel blocks, head
sub-ranges for heterogeneous tensor parallelism (P prefill ranks feeding D
decode ranks, P != D), one range packed chunk by chunk and from several
threads, and a negative test for each wrong input."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvbridge import errors
from kvbridge.layout import KVLayout, tp_head_range
from kvbridge.pack import HAS_CORE, KVRange, PagedKVCache, pack, unpack, wire_nbytes
from kvbridge.testing.engine_caches import random_fill, read_vllm, vllm_kv_caches, write_vllm
from kvbridge.testing.pack_ref import ref_pack

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")


# ---- block ratios ----------------------------------------------------------------
@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("ratio", [2, 4])
def test_manager_blocks_map_to_kernel_blocks(order: str, ratio: int) -> None:
    """vLLM splits each 64-token manager block into `ratio` kernel blocks; the
    connector's block table names manager blocks."""
    manager, kernel, blocks = 64, 64 // ratio, 6
    caches = vllm_kv_caches(
        num_layers=2, num_blocks=blocks, num_kv_heads=2, block_size=manager, head_size=16,
        dtype=torch.bfloat16, layout=order, kernel_block_size=kernel,
    )  # fmt: skip
    random_fill(caches, ratio)
    assert caches[0].shape[0] == blocks * ratio and caches[0].shape[2] == kernel
    cache = PagedKVCache.from_vllm(caches, block_tokens=manager)
    assert cache.block_ratio == ratio and cache.num_pages == blocks * ratio
    table = [4, 1, 5, 2]  # manager blocks
    start, end = 37, 3 * manager + 11
    # Independent of the core: token t of manager block b sits in kernel block
    # b * ratio + (t % manager) // kernel, slot t % kernel.
    t = torch.arange(start, end)
    slots = (
        torch.tensor(table)[t // manager] * ratio + (t % manager) // kernel
    ) * kernel + t % kernel
    k, v = read_vllm(caches, slots, 16)
    want = torch.stack([k, v], dim=1).contiguous().view(torch.uint8).reshape(-1)
    got = cache.range(table, start, end).pack()
    assert torch.equal(got, want)
    assert torch.equal(ref_pack(cache, table, start, end), want)
    # And into a cache whose manager blocks are whole kernel blocks.
    plain = vllm_kv_caches(
        num_layers=2, num_blocks=blocks, num_kv_heads=2, block_size=manager, head_size=16,
        dtype=torch.bfloat16, layout="BLHNC",
    )  # fmt: skip
    other = PagedKVCache.from_vllm(plain)
    other.range([0, 3, 2, 5], start, end).unpack(got)
    assert torch.equal(other.range([0, 3, 2, 5], start, end).pack(), want)


def test_a_ratio_that_does_not_divide_is_a_layout_error() -> None:
    caches = vllm_kv_caches(
        num_layers=1, num_blocks=4, num_kv_heads=1, block_size=16, head_size=8,
        dtype=torch.float16,
    )  # fmt: skip
    for bad in (24, 8, 0, -16):
        with pytest.raises(errors.LayoutError, match="multiple"):
            PagedKVCache.from_vllm(caches, block_tokens=bad)
    three = vllm_kv_caches(
        num_layers=1, num_blocks=3, num_kv_heads=1, block_size=16, head_size=8,
        dtype=torch.float16,
    )  # fmt: skip
    with pytest.raises(errors.LayoutError, match="whole"):
        PagedKVCache.from_vllm(three, block_tokens=32)  # 3 kernel blocks, 2 per manager block


def test_manager_block_ids_outside_the_cache() -> None:
    caches = vllm_kv_caches(
        num_layers=1, num_blocks=8, num_kv_heads=1, block_size=16, head_size=8,
        dtype=torch.float16,
    )  # fmt: skip
    cache = PagedKVCache.from_vllm(caches, block_tokens=32)  # 4 manager blocks
    with pytest.raises(errors.PageIndexError, match="outside"):
        cache.range([0, 4], 0, 64)
    with pytest.raises(errors.PageIndexError):
        cache.range([0], 0, 64)  # too short


# ---- head sub-ranges ------------------------------------------------------------
HEADS = 4


def _tp_cache(tp: int, rank: int, pages: int, seed: int) -> tuple[PagedKVCache, list[torch.Tensor]]:
    start, local = tp_head_range(HEADS, tp, rank)
    caches = vllm_kv_caches(
        num_layers=3, num_blocks=pages, num_kv_heads=local, block_size=16, head_size=32,
        dtype=torch.bfloat16, layout="LBHNC" if rank % 2 else "BLNHC",
    )  # fmt: skip
    random_fill(caches, seed)
    cache = PagedKVCache.from_vllm(caches, head_start=start, model_kv_heads=HEADS)
    return cache, caches


def _model_values(seed: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((3, tokens, HEADS, 32), generator=g).to(torch.bfloat16)
    return k, torch.randn((3, tokens, HEADS, 32), generator=g).to(torch.bfloat16)


def test_head_ranges_p2_to_d1_and_p1_to_d2() -> None:
    start, end = 5, 77
    t = torch.arange(start, end)
    k, v = _model_values(1, end - start)
    full_wire = torch.stack([k, v], dim=1).contiguous().view(torch.uint8).reshape(-1)

    # P = 2 prefill ranks, each holding half the heads, written by vLLM.
    senders = []
    for rank in range(2):
        cache, caches = _tp_cache(2, rank, 8, 10 + rank)
        h0, h1 = cache.layout.head_range
        table = [7, 2, 5, 0, 3]
        write_vllm(
            caches, torch.tensor(table)[t // 16] * 16 + t % 16, k[:, :, h0:h1], v[:, :, h0:h1]
        )
        senders.append((cache, table))
    # D = 1 decode rank holding all heads accepts each sender's heads.
    recv, recv_caches = _tp_cache(1, 0, 9, 20)
    rtable = [1, 8, 4, 6, 2]
    for cache, table in senders:
        heads = cache.layout.head_range
        wire = cache.range(table, start, end).pack()  # the sender's own heads
        assert wire.numel() == wire_nbytes(cache.layout, start, end) == full_wire.numel() // 2
        assert recv.layout.wire_nbytes(end - start, heads=heads) == wire.numel()
        recv.range(rtable, start, end, heads=heads).unpack(wire)
    assert torch.equal(recv.range(rtable, start, end).pack(), full_wire)
    got_k, got_v = read_vllm(recv_caches, torch.tensor(rtable)[t // 16] * 16 + t % 16, 32)
    assert torch.equal(got_k.view(torch.int16), k.view(torch.int16))
    assert got_v is not None and torch.equal(got_v.view(torch.int16), v.view(torch.int16))

    # P = 1 prefill rank feeding D = 2 decode ranks: one wire per receiver's heads.
    for rank in range(2):
        d, d_caches = _tp_cache(2, rank, 6, 30 + rank)
        heads = d.layout.head_range
        wire = recv.range(rtable, start, end, heads=heads).pack()
        dtable = [5, 0, 3, 1, 4]
        d.range(dtable, start, end).unpack(wire)
        dk, dv = read_vllm(d_caches, torch.tensor(dtable)[t // 16] * 16 + t % 16, 32)
        h0, h1 = heads
        assert torch.equal(dk.view(torch.int16), k[:, :, h0:h1].view(torch.int16))
        assert dv is not None and torch.equal(
            dv.view(torch.int16), v[:, :, h0:h1].view(torch.int16)
        )
        assert torch.equal(wire, ref_pack(recv, rtable, start, end, heads=heads))


def test_wire_of_a_head_range_keeps_the_full_range_layout() -> None:
    """The full head range's wire is unchanged; a sub-range's rows are the
    full rows' bytes at wire_head_slice."""
    lay = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="fp16", page_tokens=4)
    cache = PagedKVCache.allocate(lay, 6, fill="random", seed=3)
    bt = [5, 1, 4, 0, 2]
    full = pack(cache, bt, 2, 19)
    assert np.array_equal(full, pack(cache, bt, 2, 19, heads=(0, 4)))
    part = pack(cache, bt, 2, 19, heads=(1, 3))
    off, n, row = lay.wire_head_slice((1, 3))
    assert (off, n, row) == (16, 32, 64)
    rows = full.reshape(-1, row)
    assert np.array_equal(part.reshape(-1, n), rows[:, off : off + n])
    assert lay.wire_head_slice((1, 2), within=(1, 3)) == (0, 16, 32)


def test_bad_head_ranges() -> None:
    cache, _ = _tp_cache(2, 1, 4, 1)  # heads [2, 4) of 4
    for bad in [(0, 2), (1, 3), (2, 5), (3, 3), (3, 2), (-1, 2)]:
        with pytest.raises(errors.LayoutError, match="outside"):
            cache.range([0, 1], 0, 20, heads=bad)
        with pytest.raises(errors.LayoutError):
            cache.layout.wire_nbytes(20, heads=bad)
    with pytest.raises(errors.LayoutError):
        cache.range([0, 1], 0, 20, heads=(2.0, 3))  # type: ignore[arg-type]
    with pytest.raises(errors.LayoutError):
        KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, head_start=3, model_kv_heads=4)
    with pytest.raises(errors.LayoutError, match="model_kv_heads"):
        KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, head_start=2)
    with pytest.raises(errors.LayoutError):
        tp_head_range(6, 4, 0)
    assert tp_head_range(2, 8, 5) == (1, 1)  # more ranks than heads: replicated


def test_tensor_parallel_layouts_share_the_model_key() -> None:
    a = KVLayout.for_model("llama-3-8b", tp_size=4, tp_rank=3)
    full = KVLayout.for_model("llama-3-8b")
    assert (a.num_kv_heads, a.head_range, a.total_kv_heads) == (2, (6, 8), 8)
    assert a.compat_hash == full.compat_hash
    assert a.exact_hash != full.exact_hash
    assert a.exact_hash != KVLayout.for_model("llama-3-8b", tp_size=4, tp_rank=2).exact_hash
    assert full == KVLayout.for_model("llama-3-8b", tp_size=1)
    assert a.wire_nbytes(10) == full.wire_nbytes(10) // 4


# ---- one range, many chunks --------------------------------------------------------
def test_one_range_chunks_threads_and_reuse() -> None:
    lay = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    cache = PagedKVCache.allocate(lay, 64, fill="random", seed=4)
    tables = [np.random.default_rng(i).permutation(64)[:40] for i in range(6)]
    ranges = [cache.range(t, i, 600 - i, writable=False) for i, t in enumerate(tables)]

    def job(i: int) -> bool:
        rng = ranges[i]
        out = np.empty(rng.nbytes, np.uint8)
        step = rng.nbytes // 7 + 13
        for off in range(0, rng.nbytes, step):
            n = min(step, rng.nbytes - off)
            rng.pack(out[off : off + n], offset=off, nbytes=n, num_threads=2)
        return bool(np.array_equal(out, ref_pack(cache, tables[i], i, 600 - i).numpy()))

    with ThreadPoolExecutor(max_workers=3) as ex:
        assert all(ex.map(job, range(6)))
    # The table was copied: changing the caller's array does not change the range.
    before = ranges[0].pack()
    tables[0][:] = 0
    assert np.array_equal(ranges[0].pack(), before)
    with pytest.raises(errors.InvalidArgument, match="writable"):
        ranges[0].unpack(before)
    assert isinstance(ranges[0], KVRange) and "KVRange" in repr(ranges[0])


def test_unpack_range_checks_pages_once_and_slices_each_time() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="fp16", page_tokens=4)
    cache = PagedKVCache.allocate(lay, 4, fill="random", seed=5)
    with pytest.raises(errors.OverlapError):
        cache.range([3, 1, 3, 2], 2, 14)  # a page twice: refused when the range is made
    cache.range([3, 1, 3, 2], 2, 14, writable=False)  # packing reads it twice: fine
    rng = cache.range([3, 1, 0, 2], 2, 14)
    wire = rng.pack()
    with pytest.raises(errors.InvalidArgument):
        rng.unpack(wire, offset=1)
    with pytest.raises(errors.BufferTooSmall):
        rng.pack(np.zeros(3, np.uint8))
    rng.unpack(wire[5:], offset=5)
    unpack(cache, [3, 1, 0, 2], 2, 14, wire[:5])
    assert np.array_equal(rng.pack(), wire)


# ---- strides that overlap ----------------------------------------------------------
def test_vllm_views_whose_strides_overlap_are_refused() -> None:
    raw = torch.zeros(1 << 16, dtype=torch.bfloat16)
    good = torch.as_strided(raw, (4, 2, 16, 64), (2 * 16 * 64, 16 * 64, 64, 1))
    PagedKVCache.from_vllm([good])
    # Heads 32 elements apart, but a head's tokens span 16 * 64: they overlap.
    bad = torch.as_strided(raw, (4, 2, 16, 64), (2 * 16 * 64, 32, 64, 1))
    with pytest.raises(errors.LayoutError, match="overlap"):
        PagedKVCache.from_vllm([bad])
    # Two layers on the same bytes: fine to read, refused for a write range.
    twice = PagedKVCache.from_vllm([good, good])
    twice.range([0, 1], 0, 20, writable=False).pack()
    with pytest.raises(errors.OverlapError, match="overlap"):
        twice.range([0, 1], 0, 20)
    with pytest.raises(errors.ShapeError):
        PagedKVCache.from_vllm([torch.zeros(4, 2, 16, 63, dtype=torch.bfloat16)])  # odd content
    with pytest.raises(errors.DTypeError, match="fp8"):
        PagedKVCache.from_vllm([torch.zeros(4, 2, 16, 64, dtype=torch.uint8)])
    fp8 = PagedKVCache.from_vllm([torch.zeros(4, 2, 16, 64, dtype=torch.uint8)], dtype="fp8_e4m3")
    assert fp8.layout.dtype.value == "fp8_e4m3"


def test_random_ranges_of_vllm_caches_match_the_reference() -> None:
    rng = random.Random(11)
    for order in ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]:
        caches = vllm_kv_caches(
            num_layers=3, num_blocks=9, num_kv_heads=3, block_size=8, head_size=8,
            dtype=torch.float16, layout=order,
        )  # fmt: skip
        random_fill(caches, rng.randrange(1000))
        cache = PagedKVCache.from_vllm(caches)
        for _ in range(8):
            s = rng.randrange(60)
            e = rng.randrange(s, 72)
            l0 = rng.randrange(3)
            l1 = rng.randrange(l0, 4)
            h0 = rng.randrange(3)
            h1 = rng.randrange(h0 + 1, 4)
            bt = rng.sample(range(9), 9)
            got = pack(cache, bt, s, e, layers=(l0, l1), heads=(h0, h1))
            assert torch.equal(got, ref_pack(cache, bt, s, e, (l0, l1), (h0, h1))), order
