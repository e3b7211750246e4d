"""A free-list page allocator for a paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidArgument, PageIndexError, ResourceLimit


class PageAllocator:
    """Hands out page ids in ``[0, num_pages)``; lowest free ids first."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise InvalidArgument(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() yields the lowest id
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages; raise :class:`ResourceLimit` (taking none) if too few."""
        if n < 0:
            raise InvalidArgument(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise ResourceLimit(f"KV cache full: {n} pages wanted, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; a page that is not allocated raises (none is freed)."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise PageIndexError(f"freeing pages that are not allocated: {bad or pages}")
        self._used.difference_update(pages)
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)
