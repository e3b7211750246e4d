"""The decode-side radix cache, its page allocator, and prefix negotiation."""

from __future__ import annotations

from .allocator import OutOfPages, PageAllocator
from .hashing import HASH_BYTES, page_hash, page_hashes, root_hash
from .radix import CacheStats, InsertResult, Match, Pin, RadixCache, StaleHandle

__all__ = [
    "HASH_BYTES",
    "CacheStats",
    "InsertResult",
    "Match",
    "OutOfPages",
    "PageAllocator",
    "Pin",
    "RadixCache",
    "StaleHandle",
    "page_hash",
    "page_hashes",
    "root_hash",
]
