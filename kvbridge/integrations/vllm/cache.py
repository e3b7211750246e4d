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

from typing import Any

from ...errors import Unavailable
from ...pack import PagedKVCache

__all__ = ["describe_vllm_cache"]


def _kv_split() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "last_dim"


def describe_vllm_cache(
    tensors: list[Any], block_size: int, kv_cache_config: Any = None, *, name: str = ""
) -> tuple[PagedKVCache, int]:
    """The cache over ``tensors`` (in layer order) and the number of kernel
    blocks per vLLM block that the caller must still map (always 1: the
    cache maps vLLM's block tables itself)."""
    from_vllm = getattr(PagedKVCache, "from_vllm", None)
    if from_vllm is None:
        raise Unavailable(
            "this kvbridge's PagedKVCache cannot describe vLLM's strided KV views "
            "(PagedKVCache.from_vllm, docs/layouts.md)"
        )
    cache: PagedKVCache = from_vllm(
        tensors, kv_split=_kv_split(), block_tokens=int(block_size), name=name
    )
    return cache, 1
