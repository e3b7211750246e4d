"""KV caches built exactly as real engines build them, for tests and benchmarks.

vLLM 0.32.0 (``vllm/v1/kv_cache_interface.py``: ``compute_layer_kv_cache_shape_bytes``,
``compute_layout_strides``, ``create_kv_cache_views``;
``vllm/v1/core/kv_cache_utils.py``: ``get_kv_cache_config_from_groups``;
``vllm/v1/worker/utils.py``: ``allocate_kv_cache``): one zeroed int8 buffer of
``num_blocks * num_layers * page`` bytes; each layer is a strided view of it,
logically ``[blocks, heads, block_size, content bytes]`` and viewed as the KV
dtype, ``[blocks, heads, block_size, 2 * head_size]``, with the physical order
of ``[L, B, H, N, C]`` given by the layout name (``KVCacheLayout``).  With a
kernel block size smaller than the manager's, the layer-compact layouts split
each manager block into equal kernel blocks (block stride / ratio).

How K and V sit in the content dimension depends on the attention backend:
the GPU backends (FlashAttention, FlashInfer, Triton) read ``[..., :head_size]``
as K and ``[..., head_size:]`` as V; vLLM's CPU backend (ISA ``vec``/``vec16``)
views each head's ``[block_size, 2 * head_size]`` tile as ``[2 * block_size,
head_size]``, takes the first half as K stored transposed (``[head_size]
[block_size]``: element ``d`` of token ``n`` at ``d * block_size + n``) and
the second half as V (``[block_size][head_size]``).  The ``write_*`` functions
put token values where the engine's own writers put them (checked against
vLLM's ``cpu_attn_reshape_and_cache`` where vLLM is installed).

SGLang 0.5.23 (``sglang/srt/mem_cache/memory_pool.py``, ``MHATokenToKVPool.
_create_buffers_normal``, ``MLATokenToKVPool._create_buffers``): per layer a
K and a V buffer ``[size + page_size, heads, head_dim]`` (NHD token slots) that
are the two halves of one ``[2, padded, heads, head_dim]`` allocation; with
``SGLANG_USE_HND_KVCACHE``, ``[pages, heads, page_size, head_dim]``; MLA: one
``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`` buffer per layer.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgument, LayoutError

__all__ = [
    "VLLM_LAYOUTS",
    "random_fill",
    "read_sglang",
    "read_vllm",
    "sglang_mha_buffers",
    "sglang_mla_buffers",
    "vllm_kv_caches",
    "write_sglang",
    "write_vllm",
]

# vLLM's KVCacheLayout: the logical axes [L, B, H, N, C] in physical order.
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def _layout_strides(
    shape: tuple[int, ...], order: tuple[int, ...], fixed: tuple[int | None, ...]
) -> tuple[int, ...]:
    """compute_layout_strides without page padding: byte strides of the
    logical [L, B, H, N, C] axes, innermost physical axis first."""
    strides = [0] * 5
    current = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def vllm_kv_caches(
    *,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    layout: str = "LBHNC",
    kernel_block_size: int | None = None,
    mla: bool = False,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """The per-layer views vLLM's worker hands to ``register_kv_caches`` for
    one attention group of ``num_layers`` uniform layers."""
    order = VLLM_LAYOUTS[layout]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    content = (head_size if mla else 2 * head_size) * itemsize  # C in bytes
    heads = 1 if mla else num_kv_heads
    page = heads * block_size * content  # one layer's manager block
    block_outer = order[0] == 1
    # KVCacheTensor of the group (get_kv_cache_config_from_groups).
    bytes_per_block = num_layers * page
    layer_stride, block_stride, *_ = _layout_strides(
        (num_layers, num_blocks, heads, block_size, content),
        order,
        (None, bytes_per_block if block_outer else None, None, None, None),
    )
    raw = torch.zeros(bytes_per_block * num_blocks, dtype=torch.int8, device=device)
    # create_kv_cache_views, with the kernel block split.
    kbs = block_size if kernel_block_size is None else kernel_block_size
    if block_size % kbs:
        raise LayoutError(f"kernel block size {kbs} must divide block size {block_size}")
    ratio = block_size // kbs
    if ratio > 1:
        if block_stride != page:
            raise LayoutError(f"{layout} does not store blocks as dense pages: cannot split them")
        block_stride //= ratio
    shape = (num_layers, num_blocks * ratio, heads, kbs, content)
    strides = _layout_strides(shape, order, (layer_stride, block_stride, None, None, None))
    view5 = torch.as_strided(raw, shape, strides, raw.storage_offset())
    return [view5[layer].view(dtype) for layer in range(num_layers)]


def random_fill(caches: list[torch.Tensor], seed: int = 0) -> torch.Tensor:
    """Random bytes (from ``seed``) in all of the storage under ``caches`` (vLLM's
    per-layer views of one buffer); returns that storage as a flat uint8 tensor."""
    flat = torch.empty(0, dtype=torch.uint8, device=caches[0].device)
    flat.set_(caches[0].untyped_storage())
    gen = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))
    return flat


def write_vllm(
    caches: list[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    kv_split: str = "last_dim",
) -> None:
    """Store token values where vLLM's cache writers put them: ``k`` and ``v``
    are ``[layers, tokens, heads, head_size]`` (``v`` None for MLA, ``k`` the
    latent), ``slots`` the tokens' slot ids (``block * block_size + offset``,
    kernel blocks)."""
    block_size = caches[0].shape[2]
    blocks, offs = slots // block_size, slots % block_size
    for layer, cache in enumerate(caches):
        hs = k.shape[-1]
        if v is None:
            cache[blocks, :, offs, :] = k[layer]
        elif kv_split == "last_dim":
            cache[blocks, :, offs, :hs] = k[layer]
            cache[blocks, :, offs, hs:] = v[layer]
        elif kv_split == "cpu":
            nb, nh, n, _ = cache.shape
            tile = cache.view(nb, nh, 2 * n, hs)
            key, value = tile.chunk(2, dim=2)  # the CPU backend's split
            key_t = key.view(nb, nh, hs, n)  # K is stored [head_size][block_size]
            key_t[blocks, :, :, offs] = k[layer]
            value[blocks, :, offs, :] = v[layer]
        else:
            raise InvalidArgument(f"unknown kv_split {kv_split!r}")


def read_vllm(
    caches: list[torch.Tensor],
    slots: torch.Tensor,
    head_size: int,
    *,
    mla: bool = False,
    kv_split: str = "last_dim",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token values at ``slots`` as vLLM's attention backends read them:
    ``(k, v)``, each ``[layers, tokens, heads, head_size]`` (``v`` None for MLA)."""
    block_size = caches[0].shape[2]
    blocks, offs = slots // block_size, slots % block_size
    ks, vs = [], []
    for cache in caches:
        if mla:
            ks.append(cache[blocks, :, offs, :])
        elif kv_split == "last_dim":
            ks.append(cache[blocks, :, offs, :head_size])
            vs.append(cache[blocks, :, offs, head_size:])
        else:
            nb, nh, n, _ = cache.shape
            key, value = cache.view(nb, nh, 2 * n, head_size).chunk(2, dim=2)
            ks.append(key.view(nb, nh, head_size, n)[blocks, :, :, offs])
            vs.append(value[blocks, :, offs, :])
    return torch.stack(ks), None if mla else torch.stack(vs)


def sglang_mha_buffers(
    *,
    layer_num: int,
    size: int,
    page_size: int,
    head_num: int,
    head_dim: int,
    dtype: torch.dtype,
    hnd: bool = False,
    device: str = "cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``MHATokenToKVPool``'s ``k_buffer`` and ``v_buffer`` (equal K and V
    head dims: the two halves of one allocation per layer)."""
    rows = size + page_size
    if hnd:
        if rows % page_size:
            raise LayoutError("HND needs (size + page_size) divisible by page_size")
        shape: tuple[int, ...] = (rows // page_size, head_num, page_size, head_dim)
        padded = shape[0]
    else:
        shape = (rows, head_num, head_dim)
        padded = -(-rows // page_size) * page_size
    fused = [
        torch.zeros((2, padded, *shape[1:]), dtype=dtype, device=device) for _ in range(layer_num)
    ]
    return [buf[0, : shape[0]] for buf in fused], [buf[1, : shape[0]] for buf in fused]


def sglang_mla_buffers(
    *,
    layer_num: int,
    size: int,
    page_size: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """``MLATokenToKVPool``'s ``kv_buffer``."""
    dim = kv_lora_rank + qk_rope_head_dim
    return [
        torch.zeros((size + page_size, 1, dim), dtype=dtype, device=device)
        for _ in range(layer_num)
    ]


def write_sglang(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor] | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    page_size: int,
) -> None:
    """Store token values at SGLang's token slots (``set_kv_buffer``): ``k``,
    ``v`` are ``[layers, tokens, heads, head_dim]``."""
    for layer, kb in enumerate(k_buffers):
        targets = [(kb, k[layer])]
        if v_buffers is not None and v is not None:
            targets.append((v_buffers[layer], v[layer]))
        for buf, val in targets:
            if buf.dim() == 4:  # HND pages
                buf[slots // page_size, :, slots % page_size] = val
            else:
                buf[slots] = val


def read_sglang(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor] | None,
    slots: torch.Tensor,
    *,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The token values at SGLang's token slots: ``(k, v)``, each ``[layers,
    tokens, heads, head_dim]`` (``v`` None for MLA)."""

    def get(buf: torch.Tensor) -> torch.Tensor:
        if buf.dim() == 4:
            return buf[slots // page_size, :, slots % page_size]
        return buf[slots]

    k = torch.stack([get(b) for b in k_buffers])
    return k, None if v_buffers is None else torch.stack([get(b) for b in v_buffers])
