"""In-flight dedupe in the decode-side radix cache (kvbridge.cache.negotiate):
a prefix whose KV is still arriving for one request is matched by the next
request that needs it, which waits for that transfer instead of fetching the
prefix again; if the transfer fails, the waiters fetch the range themselves.
Checked by hand-made cases and by a random model of leases over a small
page pool: no page is ever freed while a live lease or request uses it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.cache import PageAllocator, RadixCache
from kvbridge.cache.negotiate import Completion, PrefixNegotiator, make_query
from kvbridge.cache.prefix_messages import PrefixQuery
from kvbridge.errors import InvalidArgument

P = 4


def toks(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 1000, n)]


def setup(pages: int = 64) -> tuple[PrefixNegotiator, RadixCache, PageAllocator]:
    alloc = PageAllocator(pages)
    cache = RadixCache(P, allocator=alloc)
    return PrefixNegotiator(cache), cache, alloc


def query(rid: int, tokens: list[int], fetch: bool = True) -> PrefixQuery:
    return make_query(rid, np.asarray(tokens, dtype=np.int32), P, fetch=fetch)


def test_a_prefix_in_flight_is_matched_and_waited_for() -> None:
    neg, cache, alloc = setup()
    shared = toks(24)
    a = neg.handle_query(query(1, shared + toks(3, 1)), 0.0).lease
    assert a is not None and a.matched_tokens == 0 and neg.pending_pages == 6
    out = neg.handle_query(query(2, shared + toks(10, 2)), 0.1)
    b = out.lease
    assert b is not None and out.reply.matched_tokens == 24  # the prefill sends [24, 34)
    assert b.ready_tokens == 0 and b.pending_tokens == 24 and b.waits_on == {a.lease_id}
    assert b.block_table[:6] == a.block_table[:6]  # the same pages, not a second copy
    assert neg.pending_hit_tokens == 24
    neg.land(b.lease_id)  # its own suffix landed first: it still waits
    assert not neg.take_progress()
    neg.land(a.lease_id)
    prog = neg.take_progress()
    assert [c.request_id for c in prog.completed] == [1, 2]
    ca, cb = prog.completed
    assert cb.block_table[:6] == ca.block_table[:6]
    cache.validate()
    neg.finish(ca)
    neg.finish(cb)
    assert alloc.used_count == cache.cached_pages == 6 + 2  # shared + B's two full pages
    assert neg.active_leases == 0 and neg.pending_pages == 0


def test_without_the_fetch_flag_nothing_is_deduped() -> None:
    neg, _, _ = setup()
    shared = toks(24)
    neg.handle_query(query(1, shared), 0.0)
    b = neg.handle_query(query(2, shared + toks(4, 2), fetch=False), 0.0).lease
    assert b is not None and b.matched_tokens == 0 and not b.waits_on


def test_complete_refuses_a_lease_that_still_waits() -> None:
    neg, _, _ = setup()
    shared = toks(16)
    neg.handle_query(query(1, shared), 0.0)
    b = neg.handle_query(query(2, shared + toks(4, 2)), 0.0).lease
    assert b is not None
    with pytest.raises(InvalidArgument):
        neg.complete(b.lease_id)


@pytest.mark.parametrize("how", ["abort", "expire", "fetch_failed"])
def test_waiters_fetch_the_range_themselves_when_the_transfer_fails(how: str) -> None:
    neg, cache, alloc = setup()
    shared = toks(20)
    a = neg.handle_query(query(1, shared + toks(2, 1)), 0.0).lease
    b = neg.handle_query(query(2, shared + toks(6, 2)), 1.0).lease
    assert a is not None and b is not None and b.pending_tokens == 20
    a_pages = set(a.block_table[:5])
    if how == "abort":
        neg.abort(a.lease_id)
    elif how == "expire":
        assert [x.lease_id for x in neg.expire(a.deadline)] == [a.lease_id]
    else:  # a's own fallback fetch failed: modelled as an abort of its lease
        neg.abort(a.lease_id)
    prog = neg.take_progress()
    assert len(prog.fetches) == 1 and not prog.completed
    f = prog.fetches[0]
    assert (f.lease_id, f.request_id, f.start, f.end) == (b.lease_id, 2, 0, 20)
    live = neg.lease(b.lease_id)
    assert live.block_table[:5] == f.pages and not set(f.pages) & a_pages - set(f.pages)
    assert all(alloc.is_allocated(p) for p in live.block_table)
    neg.land(b.lease_id)
    assert not neg.take_progress()  # its fetch is still out
    if how == "fetch_failed":
        neg.fetch_failed(f.fetch_id)
        assert neg.active_leases == 0 and alloc.used_count == 0
        return
    neg.fetch_landed(f.fetch_id)
    (cb,) = neg.take_progress().completed
    assert cb.request_id == 2 and cb.block_table[:5] == f.pages
    neg.finish(cb)
    cache.validate()
    assert alloc.used_count == cache.cached_pages and neg.pending_pages == 0


def test_a_chain_of_waiters_falls_back_and_still_shares_what_survived() -> None:
    neg, cache, alloc = setup()
    base = toks(16)
    mid = toks(8, 5)
    a = neg.handle_query(query(1, base), 0.0).lease
    b = neg.handle_query(query(2, base + mid), 0.0).lease  # waits on a, fetches mid
    c = neg.handle_query(query(3, base + mid + toks(4, 6)), 0.0).lease  # waits on a and b
    assert a is not None and b is not None and c is not None
    assert c.waits_on == {a.lease_id, b.lease_id} and c.matched_tokens == 24
    neg.abort(a.lease_id)
    prog = neg.take_progress()
    assert sorted((f.request_id, f.start, f.end) for f in prog.fetches) == [(2, 0, 16), (3, 0, 16)]
    for f in prog.fetches:
        neg.fetch_landed(f.fetch_id)
    neg.land(c.lease_id)
    assert not neg.take_progress().completed  # c still waits on b's pages [16, 24)
    neg.land(b.lease_id)
    done = neg.take_progress().completed
    assert [x.request_id for x in done] == [2, 3]
    cb, cc = done
    assert cc.block_table[4:6] == cb.block_table[4:6]  # b's pages, shared
    for x in done:
        neg.finish(x)
    cache.validate()
    assert alloc.used_count == cache.cached_pages


def test_the_first_waiter_takes_over_the_failed_pages_the_next_need_room() -> None:
    neg, _, alloc = setup(pages=12)
    shared = toks(16)
    a = neg.handle_query(query(1, shared), 0.0).lease  # 4 pages
    b = neg.handle_query(query(2, shared + toks(16, 3)), 0.0).lease  # 4 more
    c = neg.handle_query(query(3, shared + toks(12, 4)), 0.0).lease  # 3 more
    assert a is not None and b is not None and c is not None and alloc.free_count == 1
    neg.abort(a.lease_id)
    prog = neg.take_progress()
    # b refetches into a's own pages (nothing writes into them any more); c finds
    # no room for a second copy and fails: its request fails, nothing leaks
    assert [f.lease_id for f in prog.fetches] == [b.lease_id]
    assert prog.fetches[0].pages == a.block_table[:4]
    assert [x.lease_id for x in prog.failed] == [c.lease_id]
    assert alloc.used_count == 8 and neg.active_leases == 1


def test_the_prefix_a_waiter_uses_stays_pinned_after_its_owner_finished() -> None:
    neg, cache, alloc = setup(pages=16)
    shared = toks(16)
    a = neg.handle_query(query(1, shared), 0.0).lease
    b = neg.handle_query(query(2, shared + toks(8, 4)), 0.0).lease
    assert a is not None and b is not None
    neg.land(a.lease_id)
    (ca,) = neg.take_progress().completed
    neg.finish(ca)  # the owner is done; its pages stay cached, pinned for b
    assert cache.evict(100) == []
    neg.land(b.lease_id)
    (cb,) = neg.take_progress().completed
    assert cb.block_table[:4] == ca.block_table[:4]
    neg.finish(cb)
    assert len(cache.evict(100)) == cache.stats.inserted_pages == 6
    assert alloc.used_count == 0


# ---- a random model: no page freed while in use ---------------------------------------
def _check(
    neg: PrefixNegotiator, alloc: PageAllocator, done: dict[int, Completion], cache: RadixCache
) -> None:
    cache.validate()
    for lease_id in list(neg._leases):
        for p in neg.lease(lease_id).block_table:
            assert alloc.is_allocated(p), f"lease {lease_id} uses free page {p}"
    for c in done.values():
        for p in c.block_table:
            assert alloc.is_allocated(p), f"request {c.request_id} uses free page {p}"


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_leases_never_use_a_free_page(seed: int) -> None:
    rng = random.Random(seed)
    neg, cache, alloc = setup(pages=rng.choice([12, 24, 48]))
    prefixes = [toks(rng.choice([8, 12, 16]), rng.randrange(4)) for _ in range(4)]
    done: dict[int, Completion] = {}
    landed: set[int] = set()
    fetches: dict[int, int] = {}  # fetch id -> lease id
    rid = 0
    for _ in range(60):
        op = rng.random()
        live = list(neg._leases)
        if op < 0.35:
            rid += 1
            tokens = rng.choice(prefixes) + toks(rng.randrange(0, 9), 100 + rid)
            neg.handle_query(query(rid, tokens, fetch=rng.random() < 0.8), float(rid))
        elif op < 0.55 and live:
            lid = rng.choice(live)
            if lid not in landed:
                landed.add(lid)
                neg.land(lid)
        elif op < 0.65 and live:
            neg.abort(rng.choice(live))
        elif op < 0.75 and fetches:
            fid = rng.choice(list(fetches))
            del fetches[fid]
            if rng.random() < 0.8:
                neg.fetch_landed(fid)
            else:
                neg.fetch_failed(fid)
        elif op < 0.85 and done:
            neg.finish(done.pop(rng.choice(list(done))))
        elif op < 0.9:
            neg.expire(float(rid) - 20.0)
        prog = neg.take_progress()
        for c in prog.completed:
            done[c.request_id] = c
        for f in prog.fetches:
            fetches[f.fetch_id] = f.lease_id
        fetches = {f: lid for f, lid in fetches.items() if lid in neg._leases}
        _check(neg, alloc, done, cache)
    # drain: land everything, fetches too, then finish every request
    for _ in range(10):
        for lid in list(neg._leases):
            if lid not in landed:
                landed.add(lid)
                neg.land(lid)
        for fid in list(fetches):
            del fetches[fid]
            neg.fetch_landed(fid)
        prog = neg.take_progress()
        for c in prog.completed:
            done[c.request_id] = c
        for f in prog.fetches:
            fetches[f.fetch_id] = f.lease_id
        _check(neg, alloc, done, cache)
    assert neg.active_leases == 0 and neg.pending_pages == 0
    for c in list(done.values()):
        neg.finish(c)
    cache.validate()
    assert alloc.used_count == cache.cached_pages
