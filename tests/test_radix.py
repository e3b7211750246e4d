"""Unit tests of the decode-side radix cache, its hashes and its allocator."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from kvbridge.cache import OutOfPages, PageAllocator, RadixCache, StaleHandle
from kvbridge.cache.hashing import page_hash, page_hashes, root_hash
from kvbridge.errors import InvalidArgument, OverlapError, PageIndexError

P = 4


def seq(*vals: int, n: int = P) -> list[int]:
    """One page per value: [v, v, v, v]."""
    return [v for v in vals for _ in range(n)]


def test_hashes_are_stable_and_chained() -> None:
    toks = list(range(10))
    hs = page_hashes(toks, 4)
    assert len(hs) == 2  # the partial tail has no hash
    assert hs[0] == page_hash(root_hash(4), [0, 1, 2, 3])
    assert hs[1] == page_hash(hs[0], [4, 5, 6, 7])
    # fixed value: the hash is part of the wire protocol and must never change
    assert hs[0].hex() == page_hashes(np.arange(4, dtype=np.int64), 4)[0].hex()
    # test vectors of docs/radix-cache.md, recomputed from the definition
    root = hashlib.blake2b((16).to_bytes(4, "little"), digest_size=16, person=b"kvbridge-radix1")
    assert root_hash(16) == root.digest()
    assert root_hash(16).hex() == "05667fe1a9a2c678440fd7777babb242"
    first = hashlib.blake2b(root.digest() + struct.pack("<16i", *range(16)), digest_size=16)
    assert page_hashes(list(range(16)), 16)[0] == first.digest()
    assert first.hexdigest() == "8a8c96102bd6473a9a9effebab3a5636"
    # same page content, different parent -> different key
    assert page_hashes([9, 9, 9, 9, 1, 2, 3, 4], 4)[1] != page_hashes([1, 2, 3, 4], 4)[0]
    assert page_hashes(toks, 4, b"lora-1") != hs
    assert page_hashes(toks, 5)[0] != page_hashes(toks[:5], 4)[0]


@pytest.mark.parametrize("bad", [[-1], [1 << 31], [[1, 2]], [1.5]])
def test_bad_token_ids_rejected(bad: list[object]) -> None:
    with pytest.raises(InvalidArgument):
        page_hashes(bad, 1)  # type: ignore[arg-type]


def test_allocator_rejects_double_free_atomically() -> None:
    a = PageAllocator(4)
    got = a.alloc(3)
    assert got == [0, 1, 2]
    with pytest.raises(OutOfPages):
        a.alloc(2)
    with pytest.raises(InvalidArgument):
        a.free([0, 0])
    with pytest.raises(InvalidArgument):
        a.free([1, 3])
    with pytest.raises(PageIndexError):
        a.free([7])
    assert a.used_count == 3  # nothing was freed by the failed calls
    a.free(got)
    assert a.free_count == 4


def test_lookup_insert_full_pages_only() -> None:
    c = RadixCache(P)
    toks = [*seq(1, 2, 3), 7, 7]  # 3 full pages + partial tail
    r = c.insert(toks, [10, 11, 12, 13])
    assert r.pages == (10, 11, 12) and r.uncached == (13,) and r.new_pages == 3
    m = c.lookup(toks)
    assert m.num_tokens == 12 and m.pages == (10, 11, 12)
    # a query that diverges inside page 2 matches only pages 0 and 1
    m = c.lookup([*seq(1, 2), 3, 3, 3, 9])
    assert m.num_tokens == 8 and m.pages == (10, 11)
    # a shorter query whose last page is partial matches only full pages
    m = c.lookup([*seq(1, 2), 3, 3])
    assert m.num_tokens == 8
    assert c.lookup(seq(5)).num_tokens == 0
    assert c.lookup([]).num_tokens == 0
    assert c.stats.hits == 3 and c.stats.lookups == 5
    c.validate()


def test_insert_dedups_against_cached_prefix() -> None:
    c = RadixCache(P)
    c.insert(seq(1, 2), [0, 1])
    r = c.insert(seq(1, 2, 3), [5, 6, 7])
    assert r.pages == (0, 1, 7)
    assert r.duplicates == (5, 6) and r.new_pages == 1
    assert c.lookup(seq(1, 2, 3)).pages == (0, 1, 7)
    c.validate()


def test_insert_rejects_bad_block_tables_without_change() -> None:
    c = RadixCache(P)
    c.insert(seq(1, 2), [0, 1])
    with pytest.raises(OverlapError):
        c.insert(seq(3, 4), [5, 5])
    with pytest.raises(InvalidArgument):
        c.insert(seq(3, 4), [1, 9])  # page 1 already caches another prefix
    with pytest.raises(InvalidArgument):
        c.insert(seq(3, 4, 5), [8, 9])  # too few pages
    assert c.cached_pages == 2
    c.validate()


def test_lru_evicts_leaves_first_and_never_pinned() -> None:
    c = RadixCache(P)
    c.insert(seq(1, 2, 3), [0, 1, 2])
    c.insert(seq(1, 5), [0, 3])
    c.lookup(seq(1, 2, 3))  # touch the 1-2-3 branch: 1-5 is now the LRU leaf
    assert c.evict(1) == [3]
    pin = c.pin(c.lookup(seq(1, 2)))
    assert c.pinned_pages == 2
    assert c.evict(10) == [2]  # 1 and 2 are pinned
    c.release(pin)
    assert c.evict(10) == [1, 0]  # leaf first, then its parent
    assert c.cached_pages == 0
    with pytest.raises(StaleHandle):
        c.release(pin)
    c.validate()


def test_pin_of_evicted_match_is_refused() -> None:
    c = RadixCache(P)
    c.insert(seq(1), [0])
    m = c.lookup(seq(1))
    c.evict(1)
    with pytest.raises(StaleHandle):
        c.pin(m)


def test_budget_and_allocator() -> None:
    alloc = PageAllocator(8)
    c = RadixCache(P, allocator=alloc, budget_pages=4)
    pages = c.allocate(3)
    r = c.insert(seq(1, 2, 3), pages, pin=True)
    assert r.pin is not None and c.pinned_pages == 3
    pages2 = c.allocate(3)
    c.insert(seq(4, 5, 6), pages2)  # over budget: evicts 2 of its own (the rest is pinned)
    assert c.cached_pages == 4 and alloc.free_count == 8 - 4
    c.release(r.pin)
    # allocating more than is free evicts LRU pages into the allocator
    got = c.allocate(8)
    assert len(got) == 8 and c.cached_pages == 0
    with pytest.raises(OutOfPages):
        c.allocate(1)
    c.validate()


def test_insert_with_hashes_matches_token_insert() -> None:
    c = RadixCache(P)
    toks = [*seq(3, 1, 4, 1), 5]
    c.insert_hashes(c.hashes(toks), [4, 3, 2, 1, 0])
    m = c.lookup(toks)
    assert m.pages == (4, 3, 2, 1)
    assert c.lookup_hashes(c.hashes(toks)[:2]).pages == (4, 3)
    with pytest.raises(InvalidArgument):
        c.lookup_hashes([b"short"])


def test_insert_rejects_hashes_that_do_not_chain() -> None:
    c = RadixCache(P)
    hs = c.hashes(seq(1, 2))
    c.insert_hashes(hs, [0, 1])
    with pytest.raises(InvalidArgument):
        c.insert_hashes([b"\x01" * 16, hs[1]], [5, 6])  # hs[1] already lives elsewhere
    with pytest.raises(InvalidArgument):
        c.insert_hashes([b"\x01" * 16, b"\x01" * 16], [5, 6])  # repeated hash
    assert c.cached_pages == 2
    c.validate()


def test_lru_heap_stays_bounded_under_lookups() -> None:
    c = RadixCache(P)
    c.insert(seq(1, 2), [0, 1])
    for _ in range(10_000):
        c.lookup(seq(1, 2))
    assert len(c._heap) <= 4 * c.cached_pages + 65
    assert c.evict(1) == [1]
