"""Pack and unpack KV-cache pages: the Python face of the C++/CUDA core.

A :class:`PagedKVCache` describes one engine's cache: its :class:`KVLayout`
and, for every layer and component (K, V or the MLA latent), a base address
and the byte strides of page, token, head and element.  It is built from the
engine's tensors as they are -- kvbridge's own shapes (``PagedKVCache(layout,
tensors)``), vLLM's per-layer views (:meth:`PagedKVCache.from_vllm`), SGLang's
K and V buffers (:meth:`PagedKVCache.from_sglang`) or raw pointers
(:meth:`PagedKVCache.from_strided`) -- and checked once.

:meth:`PagedKVCache.range` checks one transfer's token range, layer range,
head range and block table once and returns a :class:`KVRange`, whose
:meth:`~KVRange.pack` gathers any byte slice ``[offset, offset + nbytes)`` of
the canonical wire layout (see :mod:`kvbridge.layout`) and whose
:meth:`~KVRange.unpack` scatters one, in any order; per chunk only the slice
and the buffer are checked.  On the CPU, pack can return the XXH3-64 of the
bytes it wrote and unpack can verify one, in the same pass as the copy.
:func:`pack` and :func:`unpack` do both steps per call.

Caches and buffers are numpy arrays or torch tensors, on the CPU or on a CUDA
device; nothing is copied on the way in.  Everything is validated before any
byte moves: a bad argument raises a typed :mod:`kvbridge.errors` exception and
leaves every buffer untouched.

The implementation lives in :mod:`kvbridge._pack` (``cache``: PagedKVCache;
``engines``: vLLM's and SGLang's tensors; ``range``: KVRange and the one-call
functions; ``plumbing``: argument checks and the compiled core; ``memory``:
huge pages under host buffers).  :func:`advise_huge_pages` asks the kernel
to back any host array or tensor with 2 MiB pages (``madvise``, collapsing
the pages already there); :func:`huge_page_bytes` says how many of its bytes
huge pages back now; :func:`thp_setting` is the system's THP mode.
"""

from __future__ import annotations

from ._pack.cache import ComponentStrides, PagedKVCache
from ._pack.memory import advise_huge_pages, huge_page_bytes, thp_setting
from ._pack.plumbing import BUILT_WITH_CUDA, HAS_CORE, aligned_empty, cuda_available
from ._pack.range import KVRange, pack, unpack, wire_nbytes, xxh3_64

__all__ = [
    "BUILT_WITH_CUDA",
    "HAS_CORE",
    "ComponentStrides",
    "KVRange",
    "PagedKVCache",
    "advise_huge_pages",
    "aligned_empty",
    "cuda_available",
    "huge_page_bytes",
    "pack",
    "thp_setting",
    "unpack",
    "wire_nbytes",
    "xxh3_64",
]
