"""CUDA pack/unpack against the torch reference: device and pinned host
buffers, odd (misaligned) slices, explicit streams, and errors.  Runs only where
a GPU is present and kvbridge was built with CUDA."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvbridge import errors
from kvbridge.layout import KVLayout
from kvbridge.pack import BUILT_WITH_CUDA, HAS_CORE, PagedKVCache, cuda_available, pack, unpack
from kvbridge.testing.pack_ref import ref_pack

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built"),
    pytest.mark.skipif(not BUILT_WITH_CUDA, reason="kvbridge was built without CUDA"),
    pytest.mark.skipif(not cuda_available(), reason="no CUDA device on this machine"),
]

LAYOUTS = {
    "vllm-NHD-bf16": KVLayout(
        num_layers=3, num_kv_heads=4, head_dim=64, dtype="bf16", page_tokens=16
    ),
    "fi-HND-fp16": KVLayout(
        num_layers=2,
        num_kv_heads=2,
        head_dim=128,
        dtype="fp16",
        page_tokens=64,
        order="page_first",
        head_order="HND",
        stacked=True,
    ),
    "mla-fp8": KVLayout(
        num_layers=2, num_kv_heads=1, head_dim=576, dtype="fp8_e4m3", page_tokens=64, mla=True
    ),
    "odd-fp32": KVLayout(num_layers=2, num_kv_heads=3, head_dim=5, dtype="fp32", page_tokens=7),
}


def make_case(name: str, seed: int = 0) -> tuple[PagedKVCache, torch.Tensor, int, int]:
    lay = LAYOUTS[name]
    start, end = lay.page_tokens // 2 + 1, 5 * lay.page_tokens - 3
    pages = lay.pages_for(end)
    cache = PagedKVCache.allocate(
        lay, pages + 4, backend="torch", device="cuda:0", fill="random", seed=seed
    )
    bt = torch.randperm(pages + 4, generator=torch.Generator().manual_seed(seed))[:pages]
    return cache, bt, start, end


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cuda_pack_matches_reference(name: str) -> None:
    cache, bt, start, end = make_case(name)
    ref = ref_pack(cache, bt, start, end)
    out = pack(cache, bt, start, end)
    torch.cuda.synchronize()
    assert out.is_cuda
    assert torch.equal(out.cpu(), ref)
    sub = pack(cache, bt, start, end, layers=(1, 2))
    torch.cuda.synchronize()
    assert torch.equal(sub.cpu(), ref_pack(cache, bt, start, end, (1, 2)))


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_cuda_slices_and_chunked_unpack(name: str, where: str) -> None:
    cache, bt, start, end = make_case(name, seed=1)
    ref = ref_pack(cache, bt, start, end)
    total = int(ref.numel())
    rng = random.Random(7)
    cuts = sorted({0, total, *(rng.randrange(total) | 1 for _ in range(6))})
    pieces = list(itertools.pairwise(cuts))
    # Pack each odd slice into its own buffer (misaligned against the wire).
    parts = {}
    for a, b in pieces:
        if where == "device":
            buf = torch.empty(b - a, dtype=torch.uint8, device="cuda:0")
        else:
            buf = torch.empty(b - a, dtype=torch.uint8, pin_memory=True)
        pack(cache, bt, start, end, out=buf, offset=a, nbytes=b - a)
        parts[a] = buf
    torch.cuda.synchronize()
    for a, b in pieces:
        assert torch.equal(parts[a].cpu(), ref[a:b]), (a, b)
    # Unpack them in shuffled order into another layout on the GPU.
    lay = cache.layout
    rlay = lay.replace(page_tokens=lay.page_tokens * 2 + 1, stacked=not lay.stacked)
    rpages = rlay.pages_for(end)
    recv = PagedKVCache.allocate(rlay, rpages + 1, backend="torch", device="cuda:0")
    rbt = torch.randperm(rpages + 1)[:rpages]
    rng.shuffle(pieces)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for a, _ in pieces:
            unpack(recv, rbt, start, end, parts[a], offset=a, stream=stream)
    stream.synchronize()
    assert torch.equal(ref_pack(recv, rbt, start, end), ref)


def test_cuda_pack_into_one_pinned_buffer_with_int_stream() -> None:
    cache, bt, start, end = make_case("vllm-NHD-bf16", seed=2)
    ref = ref_pack(cache, bt, start, end)
    out = torch.zeros(int(ref.numel()), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    half = int(ref.numel()) // 2 + 3
    pack(cache, bt, start, end, out=out, nbytes=half, stream=stream.cuda_stream)
    pack(cache, bt, start, end, out=out[half:], offset=half, stream=stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(out, ref)


def test_cuda_errors_leave_the_cache_alone() -> None:
    cache, bt, start, end = make_case("vllm-NHD-bf16", seed=3)
    before = cache.tensors[0].clone() if isinstance(cache.tensors, list) else cache.tensors.clone()
    wire = pack(cache, bt, start, end)
    bad = bt.clone()
    bad[1] = cache.num_pages
    with pytest.raises(errors.PageIndexError):
        unpack(cache, bad, start, end, wire)
    dup = bt.clone()
    dup[2] = dup[1]
    with pytest.raises(errors.OverlapError):
        unpack(cache, dup, start, end, wire)
    with pytest.raises(errors.InvalidArgument):  # pageable host memory
        pack(cache, bt, start, end, out=torch.empty(int(wire.numel()), dtype=torch.uint8))
    torch.cuda.synchronize()
    after = cache.tensors[0] if isinstance(cache.tensors, list) else cache.tensors
    assert torch.equal(after, before)


def test_cuda_kv_source_and_sink_round_trip() -> None:
    """The transport's KVSource reads GPU pages into pinned host buffers and
    KVSink writes them back into another GPU cache, in uneven slices."""
    from kvbridge.transport.tcp.kvio import KVSink, KVSource

    cache, bt, start, end = make_case("fi-HND-fp16", seed=4)
    ref = ref_pack(cache, bt, start, end).cpu().numpy().tobytes()
    source = KVSource(cache, bt.numpy(), start, end, None)
    recv = PagedKVCache.allocate(cache.layout, cache.num_pages, backend="torch", device="cuda:0")
    sink = KVSink(recv, bt.numpy(), start, end, None)
    step = source.nbytes // 3 + 5
    for off in range(0, source.nbytes, step):
        n = min(step, source.nbytes - off)
        got = source.read(off, n)
        assert bytes(got) == ref[off : off + n]
        into = bytearray(n)
        source.read_into(off, memoryview(into))
        assert bytes(into) == ref[off : off + n]
        sink.write(off, got)
    sink.flush()
    assert ref_pack(recv, bt, start, end).cpu().numpy().tobytes() == ref


def test_cuda_range_reused_across_chunks_and_streams() -> None:
    """A range made once (its block table staged to the device once) packs and
    unpacks many chunks; vLLM's strided views and head sub-ranges on the GPU."""
    from kvbridge.testing.engine_caches import vllm_kv_caches

    caches = vllm_kv_caches(
        num_layers=3, num_blocks=12, num_kv_heads=4, block_size=16, head_size=64,
        dtype=torch.bfloat16, layout="BLNHC", device="cuda:0",
    )  # fmt: skip
    flat = torch.empty(0, dtype=torch.uint8, device="cuda:0").set_(caches[0].untyped_storage())
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device="cuda:0"))
    cache = PagedKVCache.from_vllm(caches, model_kv_heads=4)
    bt = torch.randperm(12, generator=torch.Generator().manual_seed(5))
    for heads in [None, (1, 3)]:
        rng = cache.range(bt, 9, 12 * 16 - 4, heads=heads)
        ref = ref_pack(cache, bt, 9, 12 * 16 - 4, heads=heads)
        out = torch.empty(rng.nbytes, dtype=torch.uint8, device="cuda:0")
        step = rng.nbytes // 5 + 7
        stream = torch.cuda.Stream()
        for off in range(0, rng.nbytes, step):
            n = min(step, rng.nbytes - off)
            rng.pack(out[off : off + n], offset=off, nbytes=n, stream=stream)
        stream.synchronize()
        assert torch.equal(out.cpu(), ref)
        other = vllm_kv_caches(
            num_layers=3, num_blocks=12, num_kv_heads=4, block_size=16, head_size=64,
            dtype=torch.bfloat16, layout="LBHNC", device="cuda:0",
        )  # fmt: skip
        dst = PagedKVCache.from_vllm(other)
        into = dst.range(bt, 9, 12 * 16 - 4, heads=heads)
        for off in reversed(range(0, rng.nbytes, step)):
            n = min(step, rng.nbytes - off)
            into.unpack(out[off : off + n], offset=off)
        torch.cuda.synchronize()
        assert torch.equal(ref_pack(dst, bt, 9, 12 * 16 - 4, heads=heads), ref)
    with pytest.raises(errors.Unavailable):
        cache.range(bt, 0, 16).pack(checksum=True)
