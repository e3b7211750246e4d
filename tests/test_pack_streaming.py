"""Slices of 8 MiB and more take the pack core's streaming-store path, and
vLLM's packed K|V caches a specialised copy of whole K and V rows (vector
moves of a constant size, chosen when the CPU has AVX2 and every destination
row is 32-byte aligned; the generic copy otherwise).  These cases are large
enough to take those paths and check every byte against the plain torch
reference, for each of vLLM's six orders, each head size the specialised copy
has, a head size it has not, and wire buffers that are not 32-byte aligned."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbridge.pack import HAS_CORE, PagedKVCache  # noqa: E402
from kvbridge.testing.engine_caches import VLLM_LAYOUTS, random_fill, vllm_kv_caches  # noqa: E402
from kvbridge.testing.pack_ref import ref_pack  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

STREAM_BYTES = 8 << 20  # the core streams slices this large (csrc/pack_cpu.cpp)


def _cache(order: str, head_size: int, seed: int) -> tuple[PagedKVCache, list[int], int]:
    """A vLLM cache whose wire buffer, over a shuffled block table, is at least
    STREAM_BYTES (tokens ending in a partial block)."""
    layers, heads, block = 2, 3, 16
    per_block = layers * 2 * heads * block * head_size * 2
    blocks = STREAM_BYTES // per_block + 2
    caches = vllm_kv_caches(
        num_layers=layers, num_blocks=2 * blocks, num_kv_heads=heads, block_size=block,
        head_size=head_size, dtype=torch.bfloat16, layout=order,
    )  # fmt: skip
    random_fill(caches, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks].tolist()
    return PagedKVCache.from_vllm(caches), table, blocks * block - 5


def _aligned_buffer(nbytes: int, misalign: int) -> np.ndarray:
    """``nbytes`` of uint8 starting ``misalign`` bytes past a 64-byte boundary."""
    raw = np.empty(nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + misalign
    return raw[start : start + nbytes]


@pytest.mark.parametrize("order", sorted(VLLM_LAYOUTS))
@pytest.mark.parametrize("head_size", [32, 64, 128, 256, 80])
def test_large_slices_pack_and_unpack_every_byte(order: str, head_size: int) -> None:
    cache, table, tokens = _cache(order, head_size, seed=len(order) + head_size)
    rng = cache.range(table, 0, tokens)
    assert rng.nbytes >= STREAM_BYTES
    expected = ref_pack(cache, table, 0, tokens).numpy()
    wire = _aligned_buffer(rng.nbytes, 0)
    rng.pack(wire, num_threads=2)
    assert np.array_equal(wire, expected)

    # Unpack into a second cache of the same shape, then pack it back.
    other, _, _ = _cache(order, head_size, seed=99)
    back = other.range(table, 0, tokens)
    back.unpack(wire, num_threads=2)
    assert np.array_equal(ref_pack(other, table, 0, tokens).numpy(), expected)


@pytest.mark.parametrize("misalign", [16, 8, 1])
def test_large_slices_into_unaligned_wire_buffers(misalign: int) -> None:
    cache, table, tokens = _cache("LBHNC", 64, seed=misalign)
    rng = cache.range(table, 0, tokens)
    expected = ref_pack(cache, table, 0, tokens).numpy()
    wire = _aligned_buffer(rng.nbytes, misalign)
    rng.pack(wire, num_threads=2)
    assert np.array_equal(wire, expected)
    other, _, _ = _cache("LBHNC", 64, seed=7)
    other.range(table, 0, tokens).unpack(wire, num_threads=2)
    assert np.array_equal(ref_pack(other, table, 0, tokens).numpy(), expected)


def test_a_large_slice_that_starts_inside_a_layer() -> None:
    """A slice that does not start on a layer's K block takes the per-component
    copy up to the next layer, then the paired one."""
    cache, table, tokens = _cache("LBHNC", 128, seed=3)
    rng = cache.range(table, 0, tokens)
    expected = ref_pack(cache, table, 0, tokens).numpy()
    off = 4096 + 64
    n = rng.nbytes - off - 4096
    assert n >= STREAM_BYTES
    part = _aligned_buffer(n, 0)
    rng.pack(part, offset=off, nbytes=n, num_threads=2)
    assert np.array_equal(part, expected[off : off + n])


def test_checksummed_slices_of_a_megabyte_and_more() -> None:
    """kvbridge's own layout (contiguous runs): a checksummed pack is copied by
    the hashing loop, and an unpack of 1 MiB or more writes the cache with
    streaming stores from that loop; bytes and digests as the reference."""
    import xxhash

    from kvbridge.errors import ChecksumError
    from kvbridge.layout import KVLayout

    lay = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    pages = 160  # 64 KiB pages of each layer and component: 20 MiB of wire
    src = PagedKVCache.allocate(lay, pages, fill="random", seed=11)
    table = list(range(pages))[::-1]
    tokens = pages * lay.page_tokens - 3
    expected = ref_pack(src, table, 0, tokens).numpy()
    rng = src.range(table, 0, tokens)
    dst = PagedKVCache.allocate(lay, pages, fill=0)
    back = dst.range(table, 0, tokens)
    chunk = 4 << 20
    for off in range(0, rng.nbytes, chunk):
        n = min(chunk, rng.nbytes - off)
        out = _aligned_buffer(n, 0)
        _, digest = rng.pack(out, offset=off, nbytes=n, checksum=True)
        assert np.array_equal(out, expected[off : off + n])
        assert digest == xxhash.xxh3_64_intdigest(out.tobytes())
        back.unpack(out, offset=off, expect_checksum=digest)
    assert np.array_equal(ref_pack(dst, table, 0, tokens).numpy(), expected)
    # A wrong digest over a large slice is refused; unpacking it again repairs it.
    out = _aligned_buffer(chunk, 16)
    _, digest = rng.pack(out, nbytes=chunk, checksum=True)
    with pytest.raises(ChecksumError):
        back.unpack(out, expect_checksum=digest ^ 1)
    back.unpack(out, expect_checksum=digest)
    assert np.array_equal(ref_pack(dst, table, 0, tokens).numpy(), expected)
