"""The decode-side radix cache (DRC): which token prefixes already have KV
pages on this engine.

Keys are chained 128-bit page hashes (:mod:`kvbridge.cache.hashing`), one
tree node per full page.  Only full pages are cached: a lookup returns
``matched_pages * page_tokens`` tokens, and the partial last page of an
inserted sequence stays with the caller.  That way a cached page is never
written again (a request that extends a prefix starts a fresh page), so
sharing needs no copy-on-write.

Reference counts: :meth:`RadixCache.pin` increments a node and all its
ancestors, so a page with a pinned descendant is pinned too.  Eviction takes
least-recently-used unpinned leaves first, then their parents as they become
leaves.  The cache owns no memory; with a :class:`PageAllocator` attached,
evicted pages go back to it.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument, OverlapError
from .allocator import PageAllocator
from .hashing import HASH_BYTES, TokenIds, page_hashes, root_hash, tokens_array

__all__ = ["CacheStats", "InsertResult", "Match", "NodeHandle", "Pin", "RadixCache", "StaleHandle"]


class StaleHandle(InvalidArgument):
    """A match, pin or node handle refers to pages that were evicted, or a
    pin was released twice."""


class _Node:
    __slots__ = ("alive", "children", "depth", "key", "last", "lock", "page", "parent")

    def __init__(self, key: bytes, page: int, parent: _Node | None, depth: int, now: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.lock = 0
        self.last = now
        self.depth = depth
        self.alive = True


NodeHandle = _Node | None
"""Opaque: the deepest matched node, or ``None`` for the empty prefix."""


@dataclass(frozen=True)
class Match:
    """The cached prefix of a query: ``num_tokens`` tokens in ``pages``."""

    num_tokens: int
    pages: tuple[int, ...]
    node: NodeHandle = field(repr=False, compare=False)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class Pin:
    """A reference on a node and its ancestors; release it exactly once."""

    __slots__ = ("_node", "active")

    def __init__(self, node: NodeHandle) -> None:
        self._node = node
        self.active = True

    @property
    def num_pages(self) -> int:
        return 0 if self._node is None else self._node.depth


@dataclass(frozen=True)
class InsertResult:
    """What :meth:`RadixCache.insert` did.

    ``pages`` are the tree's pages for the full pages of the sequence (where a
    prefix was already cached, the tree's copy replaces the caller's);
    ``duplicates`` are the caller's pages that the tree did not adopt (the
    caller frees them once nothing reads them); ``uncached`` are the caller's
    pages past the last full page (the partial tail), still the caller's.
    """

    pages: tuple[int, ...]
    new_pages: int
    duplicates: tuple[int, ...]
    uncached: tuple[int, ...]
    pin: Pin | None = None


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted_pages: int = 0
    duplicate_pages: int = 0
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        """Token-weighted hit rate of all lookups."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache:
    """Radix tree of cached KV pages keyed by chained page hashes.

    ``budget_pages`` bounds the pages the tree holds: an insert or a release
    that leaves the tree above it evicts unpinned LRU leaves (possibly the
    pages just inserted, when everything else is pinned); pinned pages may
    hold the tree above the budget until they are released.  With ``allocator``, evicted pages are freed
    into it and :meth:`allocate` evicts to make room.
    """

    def __init__(
        self,
        page_tokens: int,
        *,
        allocator: PageAllocator | None = None,
        budget_pages: int | None = None,
        salt: bytes = b"",
    ) -> None:
        self.page_tokens = page_tokens
        self.root = root_hash(page_tokens, salt)
        self.salt = salt
        self.allocator = allocator
        if budget_pages is not None and budget_pages < 0:
            raise InvalidArgument(f"budget_pages must be >= 0, got {budget_pages}")
        self.budget_pages = budget_pages
        self.stats = CacheStats()
        self._index: dict[bytes, _Node] = {}
        self._owner: dict[int, _Node] = {}
        self._top: dict[bytes, _Node] = {}  # children of the root
        self._clock = 0
        self._seq = 0
        self._heap: list[tuple[int, int, _Node]] = []
        self._pinned = 0

    # ---- sizes -------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return len(self._index)

    @property
    def pinned_pages(self) -> int:
        return self._pinned

    @property
    def evictable_pages(self) -> int:
        return len(self._index) - self._pinned

    def hashes(self, tokens: TokenIds) -> list[bytes]:
        """The page hashes this cache keys ``tokens`` by (full pages only)."""
        return page_hashes(tokens, self.page_tokens, self.salt)

    # ---- lookup --------------------------------------------------------------
    def lookup(self, tokens: TokenIds) -> Match:
        """Longest cached prefix of ``tokens`` in whole pages (no pin taken)."""
        arr = tokens_array(tokens)
        return self._lookup_iter(_lazy_hashes(arr, self.page_tokens, self.root), arr.size)

    def lookup_hashes(self, hashes: Sequence[bytes], num_tokens: int | None = None) -> Match:
        """Like :meth:`lookup`, from page hashes; ``num_tokens`` (default: the
        full pages) only feeds the statistics."""
        for h in hashes:
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise InvalidArgument(f"a page hash is {HASH_BYTES} bytes")
        total = len(hashes) * self.page_tokens if num_tokens is None else num_tokens
        return self._lookup_iter(iter(hashes), total)

    def _lookup_iter(self, hashes: Iterator[bytes], total_tokens: int) -> Match:
        self._clock += 1
        pages: list[int] = []
        node: _Node | None = None
        for h in hashes:
            nxt = self._index.get(h)
            if nxt is None or nxt.parent is not node:
                break
            node = nxt
            pages.append(node.page)
        if node is not None:
            self._touch(node)
        n_tok = len(pages) * self.page_tokens
        st = self.stats
        st.lookups += 1
        st.query_tokens += total_tokens
        st.hit_tokens += n_tok
        st.hits += 1 if pages else 0
        return Match(n_tok, tuple(pages), node)

    # ---- pins ------------------------------------------------------------------
    def pin(self, match: Match | InsertResult | NodeHandle) -> Pin:
        """Protect the pages of ``match`` (and their ancestors) from eviction."""
        node = _node_of(match)
        if node is not None and not node.alive:
            raise StaleHandle("the matched pages were evicted before the pin")
        n = node
        while n is not None:
            if n.lock == 0:
                self._pinned += 1
            n.lock += 1
            n = n.parent
        return Pin(node)

    def pin_hash(self, page_hash: bytes) -> Pin:
        """Pin the cached page keyed by ``page_hash`` and its ancestors;
        :class:`StaleHandle` if no such page is cached."""
        node = self._index.get(page_hash)
        if node is None:
            raise StaleHandle("no cached page has this hash")
        return self.pin(node)

    def has_hash(self, page_hash: bytes) -> bool:
        """Whether a page keyed by ``page_hash`` is cached."""
        return page_hash in self._index

    def release(self, pin: Pin) -> None:
        """Drop a pin; the pages become evictable when no other pin holds them."""
        if not pin.active:
            raise StaleHandle("pin released twice")
        pin.active = False
        node = pin._node
        n = node
        while n is not None:
            n.lock -= 1
            if n.lock == 0:
                self._pinned -= 1
            n = n.parent
        if node is not None and node.lock == 0 and not node.children:
            self._push(node)
        self._enforce_budget()

    # ---- insert ----------------------------------------------------------------
    def insert(self, tokens: TokenIds, pages: Sequence[int], *, pin: bool = False) -> InsertResult:
        """Cache the full pages of ``tokens`` held in ``pages`` (the request's
        block table from token 0; at least ``len(tokens) // page_tokens``
        entries).  With ``pin``, the inserted path comes back pinned."""
        arr = tokens_array(tokens)
        n_full = arr.size // self.page_tokens
        if len(pages) < n_full:
            raise InvalidArgument(f"{len(pages)} pages cannot hold {n_full} full pages of tokens")
        return self.insert_hashes(self.hashes(arr), pages, pin=pin)

    def insert_hashes(
        self, hashes: Sequence[bytes], pages: Sequence[int], *, pin: bool = False
    ) -> InsertResult:
        """Like :meth:`insert`, from page hashes; pages past ``len(hashes)``
        are returned as ``uncached``."""
        n = len(hashes)
        if len(pages) < n:
            raise InvalidArgument(f"{len(pages)} pages for {n} page hashes")
        if len(set(pages)) != len(pages):
            raise OverlapError("a page id appears twice in the block table")
        # validate everything before changing anything
        parent: _Node | None = None
        plan: list[_Node | None] = []
        for i, h in enumerate(hashes):
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise InvalidArgument(f"a page hash is {HASH_BYTES} bytes")
            node = self._index.get(h)
            if node is not None and node.parent is not parent:
                raise InvalidArgument(f"page hash {i} does not chain from hash {i - 1}")
            owner = self._owner.get(pages[i])
            if owner is not None and owner is not node:
                raise InvalidArgument(f"page {pages[i]} is already cached under another prefix")
            if node is None:
                # everything below a new node is new as well
                tail = hashes[i:]
                if len(set(tail)) != len(tail) or any(h2 in self._index for h2 in tail):
                    raise InvalidArgument("the page hashes do not form one chain")
                for j in range(i + 1, n):
                    if not isinstance(hashes[j], bytes) or len(hashes[j]) != HASH_BYTES:
                        raise InvalidArgument(f"a page hash is {HASH_BYTES} bytes")
                    if pages[j] in self._owner:
                        raise InvalidArgument(f"page {pages[j]} is already cached")
                plan.extend([None] * (n - i))
                break
            plan.append(node)
            parent = node
        self._clock += 1
        now = self._clock
        out: list[int] = []
        dups: list[int] = []
        new = 0
        parent = None
        for i, h in enumerate(hashes):
            node = plan[i]
            if node is None:
                node = _Node(h, pages[i], parent, i + 1, now)
                self._index[h] = node
                self._owner[node.page] = node
                (self._top if parent is None else parent.children)[h] = node
                new += 1
            elif node.page != pages[i]:
                dups.append(pages[i])
            out.append(node.page)
            node.last = now
            parent = node
        if parent is not None and not parent.children:
            self._push(parent)
        self.stats.inserted_pages += new
        self.stats.duplicate_pages += len(dups)
        held = self.pin(parent) if pin else None
        self._enforce_budget()
        return InsertResult(tuple(out), new, tuple(dups), tuple(pages[n:]), held)

    # ---- eviction ----------------------------------------------------------------
    def evict(self, n_pages: int) -> list[int]:
        """Evict up to ``n_pages`` unpinned pages, LRU leaves first.  Returns
        the evicted page ids (already freed into the allocator, if any)."""
        out: list[int] = []
        while len(out) < n_pages and self._heap:  # _push may rebuild the heap
            last, _, node = heapq.heappop(self._heap)
            if not node.alive or node.children or node.lock or node.last != last:
                continue
            node.alive = False
            del self._index[node.key]
            del self._owner[node.page]
            parent = node.parent
            siblings = self._top if parent is None else parent.children
            del siblings[node.key]
            out.append(node.page)
            if parent is not None and not parent.children and parent.lock == 0:
                self._push(parent)
        self.stats.evicted_pages += len(out)
        if self.allocator is not None and out:
            self.allocator.free(out)
        return out

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages from the allocator, evicting to make room;
        raises :class:`~kvbridge.cache.allocator.OutOfPages` if pins forbid it."""
        if self.allocator is None:
            raise InvalidArgument("this cache has no allocator")
        short = n - self.allocator.free_count
        if short > 0:
            self.evict(short)
        return self.allocator.alloc(n)

    # ---- checks ------------------------------------------------------------------
    def validate(self) -> None:
        """Check the internal invariants; raises ``AssertionError`` (tests call this)."""

        def check(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"radix cache invariant broken: {what}")

        seen = 0
        pinned = 0
        stack = list(self._top.values())
        while stack:
            node = stack.pop()
            seen += 1
            check(node.alive and self._index.get(node.key) is node, "index")
            check(self._owner.get(node.page) is node, "page owner")
            below = sum(c.lock for c in node.children.values())
            check(node.lock >= below, "a child holds more pins than its parent")
            pinned += node.lock > 0
            for c in node.children.values():
                check(c.parent is node and c.depth == node.depth + 1, "parent link")
                stack.append(c)
        check(seen == len(self._index) == len(self._owner), "orphan nodes")
        check(pinned == self._pinned, "pinned page count")

    # ---- internals -----------------------------------------------------------------
    def _enforce_budget(self) -> None:
        if self.budget_pages is not None and len(self._index) > self.budget_pages:
            self.evict(len(self._index) - self.budget_pages)

    def _touch(self, node: _Node) -> None:
        now = self._clock
        n: _Node | None = node
        while n is not None:
            n.last = now
            n = n.parent
        if not node.children and node.lock == 0:
            self._push(node)

    def _push(self, node: _Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last, self._seq, node))
        if len(self._heap) > 4 * len(self._index) + 64:
            self._rebuild_heap()  # drop stale entries; amortised O(1) per push

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self._index.values():
            if not node.children and node.lock == 0:
                self._seq += 1
                self._heap.append((node.last, self._seq, node))
        heapq.heapify(self._heap)


def _lazy_hashes(arr: npt.NDArray[np.int32], page_tokens: int, root: bytes) -> Iterator[bytes]:
    """Chained page hashes computed on demand, so a lookup stops hashing at
    its first miss."""
    buf = arr[: (arr.size // page_tokens) * page_tokens].tobytes()
    step = page_tokens * 4
    parent = root
    for off in range(0, len(buf), step):
        parent = hashlib.blake2b(parent + buf[off : off + step], digest_size=HASH_BYTES).digest()
        yield parent


def _node_of(obj: Match | InsertResult | NodeHandle) -> NodeHandle:
    if isinstance(obj, Match):
        return obj.node
    if isinstance(obj, InsertResult):
        raise InvalidArgument("pin an insert with insert(..., pin=True)")
    return obj
