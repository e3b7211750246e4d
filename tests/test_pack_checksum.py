"""The XXH3-64 of the pack core equals the `xxhash` package's (the wire
protocol's chunk checksum) for every size class, alignment and split; pack
computes it over what it writes and unpack verifies it over what it reads, in
the same pass; a mismatch is a ChecksumError that leaves exactly the slice's
slots undefined and is repaired by unpacking the right bytes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xxhash

from kvbridge import errors
from kvbridge.layout import KVLayout
from kvbridge.pack import HAS_CORE, PagedKVCache, pack, unpack, xxh3_64
from kvbridge.testing.engine_caches import random_fill, vllm_kv_caches
from kvbridge.testing.pack_ref import ref_pack, ref_unpack

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

DATA = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
# Every branch of XXH3-64: 0, 1-3, 4-8, 9-16, 17-128, 129-240, the long loop
# around stripe (64), block (1024) and internal-buffer (256) boundaries.
SIZES = sorted(
    set(range(0, 300))
    | {n + d for n in (511, 1024, 2048, 4096, 16384, 65536, 250_000) for d in (-65, -1, 0, 1, 63)}
)


def test_one_shot_equals_xxhash_for_every_size_and_alignment() -> None:
    bad = []
    for n in SIZES:
        for align in (0, 1, 7, 8, 13):
            buf = DATA[align : align + n]
            if buf.size < n:
                continue
            if xxh3_64(buf) != xxhash.xxh3_64_intdigest(buf.tobytes()):
                bad.append((n, align))
    assert not bad
    assert xxh3_64(b"") == xxhash.xxh3_64_intdigest(b"")
    assert xxh3_64(bytearray(b"kvbridge")) == xxhash.xxh3_64_intdigest(b"kvbridge")
    assert xxh3_64(torch.from_numpy(DATA[:999])) == xxhash.xxh3_64_intdigest(DATA[:999].tobytes())
    with pytest.raises(errors.InvalidArgument):
        xxh3_64(DATA[::2])


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(num_layers=2, num_kv_heads=3, head_dim=40, dtype="fp16", page_tokens=7),
        KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16,
                 head_order="HND", order="page_first"),
        KVLayout(num_layers=3, num_kv_heads=1, head_dim=72, dtype="fp8_e4m3", page_tokens=64,
                 mla=True, stacked=True),
    ],
    ids=["nhd-odd", "hnd", "mla"],
)  # fmt: skip
def test_pack_digest_is_the_xxh3_of_the_slice(layout: KVLayout) -> None:
    """The digest of a packed slice equals xxhash over those wire bytes, for
    slices that start and end anywhere (inside elements, runs and windows)."""
    rng = random.Random(1)
    pages = 40
    cache = PagedKVCache.allocate(layout, pages, fill="random", seed=2)
    bt = rng.sample(range(pages), pages)
    start, end = 5, pages * layout.page_tokens - 9
    ref = ref_pack(cache, bt, start, end).numpy()
    rng_ = cache.range(bt, start, end, writable=False)
    offsets = [(0, ref.nbytes), (0, 0), (ref.nbytes, 0)]
    offsets += [
        (a, min(ref.nbytes - a, n))
        for a, n in ((rng.randrange(ref.nbytes), rng.choice([1, 15, 63, 64, 65, 241, 40_000, 70_001]))
                     for _ in range(40))
    ]  # fmt: skip
    for a, n in offsets:
        out = np.full(n + 3, 0xEE, np.uint8)
        got, digest = rng_.pack(out, offset=a, nbytes=n, checksum=True)
        assert got is out
        assert np.array_equal(out[:n], ref[a : a + n]) and (out[n:] == 0xEE).all()
        assert digest == xxhash.xxh3_64_intdigest(ref[a : a + n].tobytes()), (a, n)
    # The module-level call, and a threads knob that a checksummed slice ignores.
    whole, d = pack(cache, bt, start, end, checksum=True, num_threads=2)
    assert np.array_equal(whole, ref) and d == xxhash.xxh3_64_intdigest(ref.tobytes())


def test_unpack_verifies_while_scattering() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, dtype="bf16", page_tokens=16)
    src = PagedKVCache.allocate(lay, 30, fill="random", seed=3)
    bt = list(range(29, -1, -1))
    start, end = 3, 30 * 16 - 5
    wire = ref_pack(src, bt, start, end).numpy()
    dst = PagedKVCache.allocate(lay, 30, fill=0x11)
    rng = dst.range(bt, start, end)
    step = 100_003
    for off in range(0, wire.nbytes, step):
        chunk = wire[off : off + step]
        rng.unpack(chunk, offset=off, expect_checksum=xxhash.xxh3_64_intdigest(chunk.tobytes()))
    assert np.array_equal(ref_pack(dst, bt, start, end).numpy(), wire)


def test_a_wrong_checksum_leaves_exactly_the_slice_undefined() -> None:
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
    src = PagedKVCache.allocate(lay, 20, fill="random", seed=4)
    bt = list(range(20))
    start, end = 7, 300
    wire = ref_pack(src, bt, start, end).numpy()
    dst = PagedKVCache.allocate(lay, 20, fill="random", seed=5)
    expect = PagedKVCache.allocate(lay, 20, fill="random", seed=5)
    rng = dst.range(bt, start, end)
    a, n = 1000, 70_000  # several hash windows
    damaged = wire[a : a + n].copy()
    damaged[n // 2] ^= 0x40
    good_sum = xxhash.xxh3_64_intdigest(wire[a : a + n].tobytes())
    with pytest.raises(errors.ChecksumError, match="expected"):
        rng.unpack(damaged, offset=a, expect_checksum=good_sum)
    # Every byte outside the slice's slots is as before: restore the slice in
    # both and compare whole caches.
    rng.unpack(wire[a : a + n], offset=a, expect_checksum=good_sum)
    ref_unpack(
        expect, bt, start, end, _slice_into(ref_pack(expect, bt, start, end).numpy(), wire, a, n)
    )
    for x, y in zip(dst.layer_views(), expect.layer_views(), strict=True):
        assert x.tobytes() == y.tobytes()
    # A right slice with a wrong expectation is refused the same way.
    with pytest.raises(errors.ChecksumError):
        unpack(dst, bt, start, end, wire[:64], expect_checksum=good_sum)
    with pytest.raises(errors.InvalidArgument):
        rng.unpack(wire[:8], expect_checksum=-1)


def _slice_into(full: np.ndarray, wire: np.ndarray, a: int, n: int) -> np.ndarray:
    out = full.copy()
    out[a : a + n] = wire[a : a + n]
    return out


def test_checksum_for_transposed_and_strided_vllm_caches() -> None:
    caches = vllm_kv_caches(
        num_layers=2, num_blocks=12, num_kv_heads=3, block_size=32, head_size=64,
        dtype=torch.bfloat16, layout="LBHNC",
    )  # fmt: skip
    random_fill(caches)
    for split in ("cpu", "last_dim"):
        isa = "vec" if split == "cpu" else None  # the vec kernels' layout on every CPU
        cache = PagedKVCache.from_vllm(caches, kv_split=split, cpu_isa=isa)
        bt = [3, 11, 0, 7, 5, 9, 1, 2, 4, 6, 8, 10]
        ref = ref_pack(cache, bt, 17, 12 * 32 - 3).numpy()
        out, digest = cache.range(bt, 17, 12 * 32 - 3).pack(checksum=True)
        assert np.array_equal(out.numpy(), ref)
        assert digest == xxhash.xxh3_64_intdigest(ref.tobytes())


def test_checksum_over_whole_layers_of_packed_kv() -> None:
    """vLLM's packed K|V copies a layer's K and V in one pass; with a
    checksum, whole layers go that way too, and the digest stays the wire's."""
    caches = vllm_kv_caches(
        num_layers=3, num_blocks=10, num_kv_heads=2, block_size=16, head_size=64,
        dtype=torch.float16, layout="BLHNC",
    )  # fmt: skip
    random_fill(caches)
    cache = PagedKVCache.from_vllm(caches)
    bt = [7, 2, 9, 0, 5, 1]
    ref = ref_pack(cache, bt, 0, 96).numpy()
    rng = cache.range(bt, 0, 96)
    for a, n in [(0, ref.nbytes), (ref.nbytes // 3, ref.nbytes // 3 + 5), (0, ref.nbytes // 6)]:
        out, digest = rng.pack(np.empty(n, np.uint8), offset=a, nbytes=n, checksum=True)
        assert np.array_equal(out, ref[a : a + n])
        assert digest == xxhash.xxh3_64_intdigest(ref[a : a + n].tobytes())
    other = vllm_kv_caches(
        num_layers=3, num_blocks=10, num_kv_heads=2, block_size=16, head_size=64,
        dtype=torch.float16, layout="LBNHC",
    )  # fmt: skip
    dst = PagedKVCache.from_vllm(other)
    into = dst.range(bt, 0, 96)
    into.unpack(ref, expect_checksum=xxhash.xxh3_64_intdigest(ref.tobytes()))
    assert np.array_equal(ref_pack(dst, bt, 0, 96).numpy(), ref)
    with pytest.raises(errors.ChecksumError):
        into.unpack(ref, expect_checksum=xxhash.xxh3_64_intdigest(ref.tobytes()) ^ 1)
