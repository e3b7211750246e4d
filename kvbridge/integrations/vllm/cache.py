"""vLLM's KV tensors as a kvbridge :class:`~kvbridge.pack.PagedKVCache`.

vLLM (0.26 and later) hands ``register_kv_caches`` one view per attention
layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, strided
into one flat buffer in the physical order its attention backend chose.
:meth:`PagedKVCache.from_vllm` reads the byte strides from the tensors; this
module only says how the backend splits the last dimension into K and V
(the CPU backend stores each block's head tile as K transposed, then V:
``kv_split="cpu"``) and that block tables come in vLLM's (manager) blocks.
"""

from __future__ import annotations

import time
from typing import Any

from ..._pack.engines import CPU_ISAS
from ...errors import Unavailable
from ...pack import PagedKVCache

__all__ = ["ask_huge_pages", "describe_vllm_cache"]


def _kv_split() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "last_dim"


def _cpu_isa(tensors: list[Any]) -> str | None:
    """The kernel set vLLM's CPU attention backend chose for these caches (its
    own rule, ``_get_attn_isa``); None where this vLLM has no such rule."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    head_size = int(tensors[0].shape[-1]) // 2
    kernel_block = int(tensors[0].shape[2])
    isa = _get_attn_isa(tensors[0].dtype, kernel_block, head_size)
    return str(isa) if isa in CPU_ISAS else None


def describe_vllm_cache(
    tensors: list[Any],
    block_size: int,
    kv_cache_config: Any = None,
    *,
    name: str = "",
    head_start: int = 0,
    model_kv_heads: int | None = None,
) -> tuple[PagedKVCache, int]:
    """The cache over ``tensors`` (in layer order) and the number of kernel
    blocks per vLLM block that the caller must still map (always 1: the
    cache maps vLLM's block tables itself).  ``head_start`` /
    ``model_kv_heads``: a tensor-parallel rank's place among the model's KV
    heads (vLLM splits them as :func:`kvbridge.layout.tp_head_range`)."""
    from_vllm = getattr(PagedKVCache, "from_vllm", None)
    if from_vllm is None:
        raise Unavailable(
            "this kvbridge's PagedKVCache cannot describe vLLM's strided KV views "
            "(PagedKVCache.from_vllm, docs/layouts.md)"
        )
    split = _kv_split()
    isa = _cpu_isa(tensors) if split == "cpu" else None
    heads = int(tensors[0].shape[1])
    whole = head_start == 0 and (model_kv_heads is None or model_kv_heads == heads)
    cache: PagedKVCache = from_vllm(
        tensors,
        kv_split=split,
        block_tokens=int(block_size),
        name=name,
        cpu_isa=isa,
        head_start=head_start,
        model_kv_heads=None if whole else model_kv_heads,
    )
    return cache, 1


def ask_huge_pages(cache: PagedKVCache) -> str:
    """Ask for huge pages under a CPU cache (vLLM allocates it with torch, on
    4 KiB pages where the system's THP mode is ``madvise``); a phrase for the
    connector's log line saying what came of it."""
    total = cache.memory_nbytes()
    t0 = time.perf_counter()
    try:
        huge = cache.advise_huge_pages()
    except Unavailable as e:
        return f", on 4 KiB pages ({e})"
    took = time.perf_counter() - t0
    return f", {huge / max(1, total):.0%} of {total / 2**30:.2f} GiB on huge pages ({took:.2f} s)"
