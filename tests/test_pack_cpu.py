"""CPU pack/unpack against the torch reference: dtypes x memory orders x page
sizes x stacked, partial first/last pages, layer sub-ranges, empty ranges and
chunked unpack (odd boundaries, shuffled) into a cache of another layout."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from kvbridge.layout import KVLayout
from kvbridge.pack import HAS_CORE, PagedKVCache, pack, unpack, wire_nbytes
from kvbridge.testing.pack_ref import ref_pack, ref_unpack

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

DTYPES = [
    ("fp32", "numpy"),
    ("fp16", "torch"),
    ("bf16", "numpy"),
    ("bf16", "torch"),
    ("fp8_e4m3", "numpy"),
    ("fp8_e4m3", "torch"),
]
ORDERS = [
    ("kv_first", "NHD", False),
    ("kv_first", "HND", False),
    ("page_first", "NHD", False),
    ("page_first", "HND", False),
    ("kv_first", "NHD", True),  # MLA
]
PAGE_TOKENS = [1, 16, 64, 128]
# The receiver of each sender page size: another page size, the other head order,
# the other memory order, the other stacking.
RECEIVER_PT = {1: 16, 16: 64, 64: 1, 128: 16}


def make_layout(dtype: str, order: str, head: str, mla: bool, pt: int, stacked: bool) -> KVLayout:
    if mla:
        return KVLayout(
            num_layers=3,
            num_kv_heads=1,
            head_dim=24,
            dtype=dtype,
            page_tokens=pt,
            mla=True,
            stacked=stacked,
        )
    return KVLayout(
        num_layers=3,
        num_kv_heads=2,
        head_dim=16,
        dtype=dtype,
        page_tokens=pt,
        order=order,
        head_order=head,
        stacked=stacked,
    )


def receiver_layout(lay: KVLayout) -> KVLayout:
    changes: dict[str, object] = {
        "page_tokens": RECEIVER_PT.get(lay.page_tokens, 16),
        "order": "page_first" if lay.order.value == "kv_first" else "kv_first",
        "stacked": not lay.stacked,
    }
    if not lay.mla:
        changes["head_order"] = "HND" if lay.head_order.value == "NHD" else "NHD"
    return lay.replace(**changes)


def table_for(pages_needed: int, num_pages: int, rng: random.Random) -> list[int]:
    ids = list(range(num_pages))
    rng.shuffle(ids)
    return ids[:pages_needed]


def snapshot(cache: PagedKVCache) -> list[bytes]:
    return [torch.as_tensor(v).view(torch.uint8).numpy().tobytes() for v in cache.layer_views()]


def chunk_bounds(total: int, rng: random.Random, n: int = 6) -> list[tuple[int, int]]:
    cuts = sorted({0, total, *(rng.randrange(total + 1) for _ in range(n))})
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def as_numpy(buf: object) -> np.ndarray:
    return buf.numpy() if isinstance(buf, torch.Tensor) else np.asarray(buf)


@pytest.mark.parametrize("pt", PAGE_TOKENS)
@pytest.mark.parametrize(
    "order,head,mla", ORDERS, ids=["vllm-NHD", "vllm-HND", "fi-NHD", "fi-HND", "mla"]
)
@pytest.mark.parametrize("dtype,backend", DTYPES, ids=[f"{d}-{b}" for d, b in DTYPES])
def test_pack_unpack_match_reference(
    dtype: str, backend: str, order: str, head: str, mla: bool, pt: int
) -> None:
    rng = random.Random(hash((dtype, backend, order, head, mla, pt)) & 0xFFFF)
    lay = make_layout(dtype, order, head, mla, pt, stacked=pt in (16, 128))
    # Partial first and last pages (except with 1-token pages).
    start = pt // 2 + 1 if pt > 1 else 3
    end = start + 3 * pt + max(1, pt // 3)
    pages = -(-end // pt)
    sender = PagedKVCache.allocate(lay, pages + 3, backend=backend, fill="random", seed=pt)
    bt = table_for(pages, pages + 3, rng)

    wire = pack(sender, bt, start, end)
    ref = ref_pack(sender, bt, start, end)
    assert as_numpy(wire).nbytes == wire_nbytes(lay, start, end)
    np.testing.assert_array_equal(as_numpy(wire), ref.numpy())

    sub = pack(sender, np.asarray(bt), start, end, layers=(1, 3), num_threads=2)
    np.testing.assert_array_equal(as_numpy(sub), ref_pack(sender, bt, start, end, (1, 3)).numpy())

    # Receiver: another page size, head order, memory order and stacking.
    rlay = receiver_layout(lay)
    rpages = -(-end // rlay.page_tokens)
    recv = PagedKVCache.allocate(rlay, rpages + 2, backend="torch", fill=0x5A)
    expect = PagedKVCache.allocate(rlay, rpages + 2, backend="torch", fill=0x5A)
    rbt = torch.tensor(table_for(rpages, rpages + 2, rng), dtype=torch.int64)
    chunks = chunk_bounds(int(ref.numel()), rng)
    rng.shuffle(chunks)
    wire_np = ref.numpy()
    for a, b in chunks:
        unpack(recv, rbt, start, end, wire_np[a:b].copy(), offset=a)
    ref_unpack(expect, rbt, start, end, ref)
    assert snapshot(recv) == snapshot(expect)
    np.testing.assert_array_equal(ref_pack(recv, rbt, start, end).numpy(), wire_np)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_empty_range(backend: str) -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4)
    cache = PagedKVCache.allocate(lay, 4, backend=backend, fill="random")
    before = snapshot(cache)
    out = pack(cache, [], 5, 5)
    assert as_numpy(out).nbytes == 0
    unpack(cache, [], 5, 5, np.empty(0, np.uint8))
    unpack(cache, [0, 1, 2], 5, 9, b"")  # an empty chunk of a non-empty range
    assert pack(cache, [0, 1], 0, 8, layers=(1, 1)).nbytes == 0
    assert snapshot(cache) == before


def test_slices_into_one_buffer_and_bytes_like_sources() -> None:
    lay = KVLayout(
        num_layers=2, num_kv_heads=3, head_dim=5, dtype="fp16", page_tokens=7, head_order="HND"
    )
    cache = PagedKVCache.allocate(lay, 6, fill="random", seed=3)
    bt = [5, 0, 3, 1, 4]
    full = ref_pack(cache, bt, 4, 33).numpy()
    out = np.zeros(full.nbytes, np.uint8)
    for a, b in [(0, 1), (1, 97), (97, 98), (98, full.nbytes)]:
        pack(cache, bt, 4, 33, out=out[a:], offset=a, nbytes=b - a)
    np.testing.assert_array_equal(out, full)
    other = PagedKVCache.allocate(lay, 6)
    unpack(other, bt, 4, 33, bytes(full[:50]))
    unpack(other, bt, 4, 33, bytearray(full[50:]), offset=50)
    np.testing.assert_array_equal(ref_pack(other, bt, 4, 33).numpy(), full)
    # A prefix of a larger receive buffer.
    third = PagedKVCache.allocate(lay, 6)
    big = np.concatenate([full, np.full(100, 7, np.uint8)])
    unpack(third, bt, 4, 33, memoryview(big), nbytes=full.nbytes)
    np.testing.assert_array_equal(ref_pack(third, bt, 4, 33).numpy(), full)


def test_adjacent_pages_and_many_threads() -> None:
    """Large enough to split over threads; adjacent page ids coalesce into runs."""
    lay = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    cache = PagedKVCache.allocate(lay, 80, fill="random", seed=9)
    bt = list(range(10, 40)) + list(range(60, 45, -1)) + list(range(0, 10))
    start, end = 5, len(bt) * 16 - 7
    ref = ref_pack(cache, bt, start, end).numpy()
    for threads in (0, 1, 2, 5):
        np.testing.assert_array_equal(pack(cache, bt, start, end, num_threads=threads), ref)
    back = PagedKVCache.allocate(lay, 80)
    unpack(back, bt, start, end, ref, num_threads=3)
    np.testing.assert_array_equal(ref_pack(back, bt, start, end).numpy(), ref)


def test_pack_returns_buffer_of_the_cache_backend() -> None:
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=2)
    t = PagedKVCache.allocate(lay, 2, backend="torch", fill=1)
    n = PagedKVCache.allocate(lay, 2, backend="numpy", fill=1)
    assert isinstance(pack(t, [0, 1], 0, 3), torch.Tensor)
    assert isinstance(pack(n, [0, 1], 0, 3), np.ndarray)
    assert t.device == "cpu" and not t.is_cuda and t.num_pages == 2
    given = torch.zeros(100, dtype=torch.float32)  # any contiguous dtype is a byte buffer
    assert pack(t, [0, 1], 0, 3, out=given) is given
    n = wire_nbytes(lay, 0, 3)
    assert n == 48
    assert bool(given.view(torch.uint8)[:n].eq(1).all())
    assert bool(given.view(torch.uint8)[n:].eq(0).all())


def test_stacked_and_per_layer_views_agree() -> None:
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_tokens=4, stacked=True)
    cache = PagedKVCache.allocate(lay, 5, fill="random", seed=1)
    views = cache.layer_views()
    per_layer = PagedKVCache(lay.replace(stacked=False), [v.copy() for v in views])
    bt = [4, 2, 0]
    np.testing.assert_array_equal(pack(cache, bt, 1, 11), pack(per_layer, bt, 1, 11))
    assert cache.layer_ptrs[1] - cache.layer_ptrs[0] == cache.layer_nbytes


@pytest.mark.parametrize("model", ["llama-3-8b", "qwen2.5-7b", "deepseek-v3"])
def test_real_model_16_token_nhd_to_64_token_hnd(model: str) -> None:
    """A vLLM-style sender with 16-token NHD pages, a FlashInfer-style receiver
    with 64-token HND pages (MLA has no head order), a prefix-hit range."""
    send = KVLayout.for_model(model, page_tokens=16)
    recv = send.replace(page_tokens=64, order="page_first", stacked=True)
    if not send.mla:
        recv = recv.replace(head_order="HND")
    start, end = 37, 203
    sender = PagedKVCache.allocate(send, 16, backend="torch", fill="random", seed=11)
    bt = torch.randperm(16, generator=torch.Generator().manual_seed(2))[:13]
    wire = pack(sender, bt, start, end)
    assert torch.equal(wire, ref_pack(sender, bt, start, end))
    receiver = PagedKVCache.allocate(recv, 5, backend="torch")
    rbt = [4, 0, 2, 1]
    step = 1_000_003  # odd chunks, last one first
    offsets = list(range(0, int(wire.numel()), step))[::-1]
    for off in offsets:
        unpack(receiver, rbt, start, end, wire[off : off + step], offset=off)
    assert torch.equal(ref_pack(receiver, rbt, start, end), wire)


def test_concurrent_callers_share_the_thread_pool() -> None:
    """Several Python threads pack at once (the GIL is released during the copy)."""
    from concurrent.futures import ThreadPoolExecutor

    lay = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    cache = PagedKVCache.allocate(lay, 64, fill="random", seed=4)
    tables = [np.random.default_rng(i).permutation(64)[:40] for i in range(6)]

    def job(i: int) -> bool:
        got = pack(cache, tables[i], i, 600 - i, num_threads=2)
        return bool(np.array_equal(got, ref_pack(cache, tables[i], i, 600 - i).numpy()))

    with ThreadPoolExecutor(max_workers=3) as ex:
        assert all(ex.map(job, range(6)))


def test_aligned_empty_starts_at_a_line_and_allocate_uses_it() -> None:
    """kvbridge's own host buffers start at a cache line (numpy's large ones
    start 16 bytes past one), and a pack into one equals a pack into any."""
    from kvbridge.errors import InvalidArgument
    from kvbridge.layout import DType
    from kvbridge.pack import aligned_empty

    assert aligned_empty(0).shape == (0,)
    for n in (1, 4095, 1 << 20):
        for align in (64, 4096):
            b = aligned_empty(n, align)
            assert b.dtype == np.uint8 and b.shape == (n,) and b.ctypes.data % align == 0
    z = aligned_empty(1 << 20, zeroed=True)
    assert z.ctypes.data % 64 == 0 and not z.any()
    with pytest.raises(InvalidArgument, match="power of two"):
        aligned_empty(10, 48)
    with pytest.raises(InvalidArgument, match=">= 0"):
        aligned_empty(-1)
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=DType.BF16, page_tokens=16)
    for backend in ("numpy", "torch"):
        for fill in (None, 7, "random"):
            cache = PagedKVCache.allocate(lay, 8, backend=backend, fill=fill, seed=1)
            assert all(a % 64 == 0 for a, _ in cache.memory_spans())
        rng = cache.range(np.array([5, 2, 7], np.int32), 3, 40)
        want = np.asarray(rng.pack())  # into kvbridge's own buffer
        assert want.ctypes.data % 64 == 0
        odd = np.empty(rng.nbytes + 16, np.uint8)[16:]  # 16 bytes past a line at best
        rng.pack(odd)
        assert bytes(odd) == bytes(want)
    assert not PagedKVCache.allocate(lay, 4, fill=None).layer_views()[0].any()
