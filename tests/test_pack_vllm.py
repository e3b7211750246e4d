"""vLLM's own allocation code and cache writer against kvbridge (skipped where
vLLM is not importable; `make test-vllm` runs it in the vLLM environment).

The plain suite builds vLLM's tensors with a copy of its allocation math
(kvbridge.testing.engine_caches); here vLLM 0.32's ``allocate_kv_cache`` builds
them, the copy must produce the very same views, and the CPU backend's own
writer (``cpu_attn_reshape_and_cache``) stores the tokens that kvbridge packs."""

from __future__ import annotations

import random

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvbridge.pack import HAS_CORE, PagedKVCache  # noqa: E402
from kvbridge.testing.engine_caches import VLLM_LAYOUTS, read_vllm, vllm_kv_caches  # noqa: E402
from kvbridge.testing.pack_ref import ref_pack  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

LAYERS, BLOCKS, HEADS, HEAD = 3, 8, 3, 64


def vllm_caches(
    spec: object, layout: KVCacheLayout, kernel: int | None = None
) -> list[torch.Tensor]:
    """The views vLLM's worker registers with a KV connector, made by vLLM:
    a KVCacheTensor placed as get_kv_cache_config_from_groups places it, then
    allocate_kv_cache."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    per_block = spec.page_size_bytes * LAYERS  # type: ignore[attr-defined]
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, BLOCKS, LAYERS, layout,
        fixed_strides=(None, per_block if layout.is_block_outermost else None, None, None, None),
    )  # fmt: skip
    tensor = KVCacheTensor(
        size=per_block * BLOCKS, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    kernels = [kernel or spec.block_size]  # type: ignore[attr-defined]
    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernels)
    return [caches[n] for n in names]


def _same_views(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    base_a, base_b = a[0].untyped_storage().data_ptr(), b[0].untyped_storage().data_ptr()
    for x, y in zip(a, b, strict=True):
        assert (tuple(x.shape), x.stride(), x.dtype) == (tuple(y.shape), y.stride(), y.dtype)
        assert x.data_ptr() - base_a == y.data_ptr() - base_b
    assert a[0].untyped_storage().nbytes() == b[0].untyped_storage().nbytes()


@pytest.mark.parametrize("order", list(VLLM_LAYOUTS))
def test_the_copy_of_vllms_allocation_builds_the_same_views(order: str) -> None:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    theirs = vllm_caches(spec, KVCacheLayout[order])
    ours = vllm_kv_caches(
        num_layers=LAYERS, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=16, head_size=HEAD,
        dtype=torch.bfloat16, layout=order,
    )  # fmt: skip
    _same_views(theirs, ours)
    cache = PagedKVCache.from_vllm(theirs)
    assert cache.layout.memory.split(":")[1] == order
    flat = torch.empty(0, dtype=torch.uint8).set_(theirs[0].untyped_storage())
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    # The GPU backends' split (FlashAttentionImpl: kv_cache.transpose(1, 2).split(head_size, -1)).
    bt = [5, 0, 7, 2]
    t = torch.arange(3, 61)
    slots = torch.tensor(bt)[t // 16] * 16 + t % 16
    k, v = theirs[0].transpose(1, 2).split(HEAD, dim=-1)
    assert k.shape == (BLOCKS, 16, HEADS, HEAD)
    wire = cache.range(bt, 3, 61).pack()
    w = wire.view(torch.bfloat16).reshape(LAYERS, 2, 58, HEADS, HEAD)
    assert torch.equal(w[0, 0].view(torch.int16), k[slots // 16, slots % 16].view(torch.int16))
    assert torch.equal(w[0, 1].view(torch.int16), v[slots // 16, slots % 16].view(torch.int16))


def test_kernel_blocks_smaller_than_manager_blocks() -> None:
    spec = FullAttentionSpec(block_size=64, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    theirs = vllm_caches(spec, KVCacheLayout.LBHNC, kernel=16)
    ours = vllm_kv_caches(
        num_layers=LAYERS, num_blocks=BLOCKS, num_kv_heads=HEADS, block_size=64, head_size=HEAD,
        dtype=torch.float16, layout="LBHNC", kernel_block_size=16,
    )  # fmt: skip
    _same_views(theirs, ours)
    cache = PagedKVCache.from_vllm(theirs, block_tokens=64)
    flat = torch.empty(0, dtype=torch.uint8).set_(theirs[0].untyped_storage())
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    assert torch.equal(cache.range([6, 1, 3], 10, 150).pack(), ref_pack(cache, [6, 1, 3], 10, 150))


def test_mla_views() -> None:
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    theirs = vllm_caches(spec, KVCacheLayout.LBHNC)
    ours = vllm_kv_caches(
        num_layers=LAYERS, num_blocks=BLOCKS, num_kv_heads=1, block_size=16, head_size=576,
        dtype=torch.bfloat16, layout="LBHNC", mla=True,
    )  # fmt: skip
    _same_views(theirs, ours)
    cache = PagedKVCache.from_vllm(theirs, mla=True)
    assert cache.layout.mla and cache.layout.head_dim == 576


def test_the_cpu_backends_writer_stores_what_kvbridge_packs() -> None:
    """vLLM's CPU attention backend writes K and V with its own kernel; the
    wire holds exactly those values, and unpacking into another vLLM cache
    makes the backend read them back."""
    ops = pytest.importorskip("vllm._custom_ops")
    spec = FullAttentionSpec(
        block_size=32, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    src = vllm_caches(spec, KVCacheLayout.LBHNC)
    cache = PagedKVCache.from_vllm(src, kv_split="cpu", cpu_isa="vec")
    rng = random.Random(3)
    bt = rng.sample(range(BLOCKS), BLOCKS)
    start, end = 7, 5 * 32 + 11
    t = torch.arange(start, end)
    slots = torch.tensor(bt)[t // 32] * 32 + t % 32
    g = torch.Generator().manual_seed(1)
    k = torch.randn((LAYERS, end - start, HEADS, HEAD), generator=g).to(torch.bfloat16)
    v = torch.randn((LAYERS, end - start, HEADS, HEAD), generator=g).to(torch.bfloat16)
    for layer, kv in enumerate(src):
        nb, nh, n, _ = kv.shape
        key_cache, value_cache = kv.view(nb, nh, 2 * n, -1).chunk(
            2, dim=2
        )  # CPUAttentionBackendImpl
        ops.cpu_attn_reshape_and_cache(k[layer], v[layer], key_cache, value_cache, slots, "vec")
    wire = cache.range(bt, start, end).pack()
    want = torch.stack([k, v], dim=1).contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(wire, want)
    dst = vllm_caches(spec, KVCacheLayout.LBHNC)
    dst_cache = PagedKVCache.from_vllm(dst, kv_split="cpu", cpu_isa="vec")
    dbt = rng.sample(range(BLOCKS), BLOCKS)
    dst_cache.range(dbt, start, end).unpack(wire)
    dslots = torch.tensor(dbt)[t // 32] * 32 + t % 32
    got_k, got_v = read_vllm(dst, dslots, HEAD, kv_split="cpu")
    assert torch.equal(got_k.view(torch.int16), k.view(torch.int16))
    assert got_v is not None and torch.equal(got_v.view(torch.int16), v.view(torch.int16))
