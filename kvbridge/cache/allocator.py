"""A page allocator over an engine's KV cache page ids.

It owns no memory: it hands out the integers ``0 .. num_pages-1`` that name
the engine's cache pages, and takes them back.  Freeing a page that is not
allocated (a double free) raises before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidArgument, PageIndexError, ResourceLimit

__all__ = ["OutOfPages", "PageAllocator"]


class OutOfPages(ResourceLimit):
    """Not enough free pages (after any eviction the caller could do)."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"wanted {wanted} pages, {free} free")
        self.wanted = wanted
        self.free = free


class PageAllocator:
    """Free list of page ids ``[0, num_pages)``; the lowest ids go out first."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidArgument(f"num_pages must be a non-negative int, got {num_pages!r}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() takes the lowest
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def is_allocated(self, page: int) -> bool:
        return page in self._used

    def alloc(self, n: int) -> list[int]:
        """``n`` page ids, or :class:`OutOfPages` (and nothing taken)."""
        if n < 0:
            raise InvalidArgument(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; all-or-nothing on a bad or repeated id."""
        batch = list(pages)
        seen: set[int] = set()
        for p in batch:
            if not 0 <= p < self.num_pages:
                raise PageIndexError(f"page {p} outside [0, {self.num_pages})")
            if p not in self._used or p in seen:
                raise InvalidArgument(f"page {p} freed but not allocated (double free)")
            seen.add(p)
        self._used.difference_update(batch)
        self._free.extend(batch)
