"""Prefix negotiation: message codecs (byte-exact) and the main decode's logic."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.cache import PageAllocator, RadixCache
from kvbridge.cache.negotiate import PrefixNegotiator, UnknownLease, make_query, suffix_range
from kvbridge.cache.prefix_messages import (
    FRAME_PREFIX_CANCEL,
    FRAME_PREFIX_QUERY,
    FRAME_PREFIX_REPLY,
    CancelReason,
    PrefixCancel,
    PrefixQuery,
    PrefixReply,
    ReplyStatus,
    decode_prefix_message,
    encode_prefix_message,
)
from kvbridge.errors import (
    InvalidArgument,
    RemoteProtocolError,
    UnknownFrame,
    VersionMismatch,
)

P = 4


def toks(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 1000, n)]


# ---- codecs ---------------------------------------------------------------------
def test_query_bytes_are_exact() -> None:
    q = PrefixQuery(request_id=7, num_tokens=9, page_tokens=4, hashes=(b"\x11" * 16, b"\x22" * 16))
    ftype, payload = encode_prefix_message(q)
    assert ftype == FRAME_PREFIX_QUERY == 0x60
    expect = struct.pack("<BBHIQIIII", 1, 0, 0, 4, 7, 9, 0, 2, 0) + b"\x11" * 16 + b"\x22" * 16
    assert payload == expect
    assert payload[:8].hex() == "0100000004000000"
    assert decode_prefix_message(ftype, payload) == q


def test_reply_and_cancel_bytes_are_exact() -> None:
    r = PrefixReply(
        3, ReplyStatus.OK, 16, lease_id=5, matched_tokens=32, lease_ms=1500, transfer_token=b"tok"
    )
    ftype, payload = encode_prefix_message(r)
    assert ftype == FRAME_PREFIX_REPLY == 0x61
    assert payload == struct.pack("<BBHIQQII", 1, 0, 3, 16, 3, 5, 32, 1500) + b"tok"
    assert decode_prefix_message(ftype, payload) == r
    c = PrefixCancel(3, 5, CancelReason.REROUTED)
    ftype, payload = encode_prefix_message(c)
    assert ftype == FRAME_PREFIX_CANCEL == 0x62
    assert payload == struct.pack("<BBHIQQ", 1, 2, 0, 0, 3, 5)
    assert decode_prefix_message(ftype, memoryview(payload)) == c


def test_transport_can_fill_the_transfer_token() -> None:
    import dataclasses

    r = PrefixReply(1, ReplyStatus.OK, 4, lease_id=1)
    filled = dataclasses.replace(r, transfer_token=bytes(range(32)))
    assert decode_prefix_message(*encode_prefix_message(filled)) == filled


def _good_query() -> bytes:
    return PrefixQuery(1, 8, 4, (b"\x01" * 16, b"\x02" * 16)).encode()


@pytest.mark.parametrize(
    ("ftype", "payload", "exc"),
    [
        (0x60, _good_query()[:-1], RemoteProtocolError),  # truncated hash
        (0x60, _good_query() + b"\x00", RemoteProtocolError),  # trailing byte
        (0x60, _good_query()[:20], RemoteProtocolError),  # truncated header
        (0x60, b"\x02" + _good_query()[1:], VersionMismatch),
        (0x60, _good_query()[:1] + b"\x02" + _good_query()[2:], RemoteProtocolError),  # flags
        # header claims 2**32-1 hashes: rejected before any allocation
        (0x60, struct.pack("<BBHIQIIII", 1, 0, 0, 4, 1, 8, 0, 0xFFFFFFFF, 0), RemoteProtocolError),
        # more hashes than full pages of the prompt
        (
            0x60,
            struct.pack("<BBHIQIIII", 1, 0, 0, 4, 1, 4, 0, 3, 0) + b"\x01" * 48,
            RemoteProtocolError,
        ),
        (0x60, struct.pack("<BBHIQIIII", 1, 0, 0, 0, 1, 8, 0, 0, 0), RemoteProtocolError),
        (0x61, struct.pack("<BBHIQQII", 1, 9, 0, 4, 1, 0, 0, 0), RemoteProtocolError),  # status
        (0x61, struct.pack("<BBHIQQII", 1, 0, 4, 4, 1, 0, 0, 0) + b"ab", RemoteProtocolError),
        (0x61, struct.pack("<BBHIQQII", 1, 2, 0, 4, 1, 9, 0, 0), RemoteProtocolError),
        (0x62, struct.pack("<BBHIQQ", 1, 7, 0, 0, 1, 1), RemoteProtocolError),  # reason
        (0x62, struct.pack("<BBHIQQ", 1, 0, 0, 0, 1, 1)[:-1], RemoteProtocolError),
        (0x63, b"", RemoteProtocolError),  # PREFIX_FETCH shorter than its header
        (0x63, struct.pack("<BBHIQQII", 1, 0, 0, 0, 1, 1, 8, 8), RemoteProtocolError),  # empty
        (0x63, struct.pack("<BBHIQQII", 1, 1, 0, 0, 1, 1, 0, 8), RemoteProtocolError),  # reserved
        (0x63, struct.pack("<BBHIQQII", 1, 0, 2, 0, 1, 1, 0, 8) + b"a", RemoteProtocolError),
        (0x64, b"", UnknownFrame),
        (0x10, b"", UnknownFrame),
    ],
)
def test_malformed_messages_rejected(ftype: int, payload: bytes, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        decode_prefix_message(ftype, payload)


def test_messages_validate_on_construction() -> None:
    with pytest.raises(InvalidArgument):
        PrefixQuery(-1, 8, 4, ())
    with pytest.raises(InvalidArgument):
        PrefixQuery(1, 7, 4, (b"\x00" * 16, b"\x00" * 16))
    with pytest.raises(InvalidArgument):
        PrefixQuery(1, 8, 4, (b"\x00" * 15,))
    with pytest.raises(InvalidArgument):
        PrefixReply(1, ReplyStatus.OK, 4, transfer_token=b"x" * 65536)
    with pytest.raises(InvalidArgument):  # a suffix must start on a page boundary
        PrefixReply(1, ReplyStatus.OK, 16, lease_id=1, matched_tokens=33)


# ---- the main decode's logic ----------------------------------------------------
def md(num_pages: int = 64, budget: int | None = None) -> PrefixNegotiator:
    cache = RadixCache(P, allocator=PageAllocator(num_pages), budget_pages=budget)
    return PrefixNegotiator(cache, default_lease_s=5.0, max_lease_s=10.0)


def test_miss_then_hit_sends_only_the_suffix() -> None:
    neg = md()
    prompt = toks(18)
    out = neg.handle_query(make_query(1, prompt, P), now=0.0)
    assert out.reply.ok and out.reply.matched_tokens == 0 and out.lease is not None
    assert len(out.lease.block_table) == 5 and out.reply.lease_ms == 5000
    done = neg.complete(out.reply.lease_id)
    assert done.owned_pages == (done.block_table[4],)  # the partial tail
    neg.finish(done)
    # next turn: the prompt grows; 16 tokens (4 full pages) are cached
    prompt2 = [*prompt, *toks(10, seed=1)]
    out2 = neg.handle_query(make_query(2, prompt2, P), now=1.0)
    assert out2.reply.matched_tokens == 16
    assert suffix_range(out2.reply, len(prompt2)).num_tokens == 12
    assert out2.lease is not None and out2.lease.block_table[:4] == done.block_table[:4]
    neg.abort(out2.reply.lease_id)
    assert neg.cache.allocator is not None
    assert neg.cache.allocator.used_count == 4 == neg.cache.cached_pages


def test_refusals_hold_nothing() -> None:
    neg = md(num_pages=4)
    r = neg.handle_query(make_query(1, toks(16), 8), now=0.0).reply
    assert r.status is ReplyStatus.PAGE_SIZE_MISMATCH and r.page_tokens == P
    r = neg.handle_query(make_query(1, toks(20), P), now=0.0).reply  # 5 pages > 4
    assert r.status is ReplyStatus.NO_SPACE
    ok = neg.handle_query(make_query(1, toks(8), P), now=0.0)
    dup = neg.handle_query(make_query(1, toks(8), P), now=0.0).reply
    assert dup.status is ReplyStatus.BAD_QUERY and ok.reply.ok
    assert neg.active_leases == 1 and neg.cache.pinned_pages == 0
    assert suffix_range(dup, 8).num_tokens == 8


def test_cancel_and_expiry_release_everything() -> None:
    neg = md()
    prompt = toks(16)
    neg.finish(neg.complete(neg.handle_query(make_query(1, prompt, P), 0.0).reply.lease_id))
    a = neg.handle_query(make_query(2, [*prompt, *toks(8, 1)], P), now=0.0).reply
    b = neg.handle_query(make_query(3, [*prompt, *toks(8, 2)], P, lease_ms=1000), now=0.0).reply
    assert neg.cache.pinned_pages == 4 and neg.next_deadline() == 1.0
    assert neg.handle_cancel(PrefixCancel(99, a.lease_id)) is None  # wrong request id
    assert neg.handle_cancel(PrefixCancel(2, a.lease_id)) is not None
    assert neg.handle_cancel(PrefixCancel(2, a.lease_id)) is None  # already gone
    assert neg.extend(b.lease_id, now=0.5, seconds=2.0) == 2.5
    assert neg.expire(now=2.0) == []
    gone = neg.expire(now=2.5)
    assert [g.lease_id for g in gone] == [b.lease_id]
    with pytest.raises(UnknownLease):
        neg.complete(b.lease_id)
    assert neg.cache.pinned_pages == 0
    assert neg.cache.allocator is not None and neg.cache.allocator.used_count == 4


def test_concurrent_identical_prefixes_dedup_on_complete() -> None:
    neg = md()
    prompt = toks(12)
    a = neg.handle_query(make_query(1, prompt, P), 0.0)
    b = neg.handle_query(make_query(2, prompt, P), 0.0)
    assert a.lease is not None and b.lease is not None
    assert not set(a.lease.block_table) & set(b.lease.block_table)
    ca = neg.complete(a.reply.lease_id)
    cb = neg.complete(b.reply.lease_id)
    assert cb.block_table == ca.block_table  # b now reads a's (identical) pages
    assert set(cb.freed_duplicates) == set(b.lease.fresh_pages)
    neg.finish(ca)
    neg.finish(cb)
    assert neg.cache.allocator is not None and neg.cache.allocator.used_count == 3


def test_finish_inserts_the_output() -> None:
    neg = md()
    prompt = toks(10)
    done = neg.complete(neg.handle_query(make_query(1, prompt, P), 0.0).reply.lease_id)
    full = [*prompt, *toks(7, seed=5)]  # decode wrote 7 tokens: pages 2..4
    assert neg.cache.allocator is not None
    table = [*done.block_table, *neg.cache.allocate(2)]
    freed = neg.finish(done, hashes=neg.cache.hashes(full), block_table=table)
    assert freed == (table[4],)  # only the new partial tail
    assert neg.cache.lookup(full).num_tokens == 16


class KVStore:
    """A fake paged KV cache: page p holds the KV of ``P`` tokens; the 'KV'
    of token t at position i is ``t * 1000 + i``, so misplaced data shows."""

    def __init__(self, num_pages: int) -> None:
        self.data = np.full((num_pages, P), -1, dtype=np.int64)

    def write(self, table: tuple[int, ...], tokens: list[int], start: int) -> None:
        for i in range(start, len(tokens)):
            self.data[table[i // P], i % P] = tokens[i] * 1000 + i

    def read(self, table: tuple[int, ...], n: int) -> list[int]:
        return [int(self.data[table[i // P], i % P]) for i in range(n)]


def _pressure(neg: PrefixNegotiator, kv: KVStore, rounds: int, seed: int) -> int:
    """Other requests allocate and cache pages until the pool has turned over."""
    evicted = 0
    for k in range(rounds):
        prompt = toks(24, seed=seed + k)
        out = neg.handle_query(make_query(10_000 + seed + k, prompt, P), 0.0)
        if out.lease is None:
            continue
        kv.write(out.lease.block_table, prompt, out.reply.matched_tokens)
        before = neg.cache.stats.evicted_pages
        neg.finish(neg.complete(out.reply.lease_id))
        evicted += neg.cache.stats.evicted_pages - before
    return evicted


def test_eviction_race_pinned_pages_survive_and_data_is_right() -> None:
    neg = md(num_pages=40, budget=24)
    kv = KVStore(40)
    prompt = toks(40, seed=42)
    first = neg.handle_query(make_query(1, prompt[:32], P), 0.0)
    assert first.lease is not None
    kv.write(first.lease.block_table, prompt[:32], 0)
    neg.finish(neg.complete(first.reply.lease_id))
    # the race: lookup + pin, then heavy eviction pressure, then the transfer
    out = neg.handle_query(make_query(2, prompt, P), 1.0)
    assert out.reply.matched_tokens == 32 and out.lease is not None
    before = kv.read(out.lease.block_table, 32)
    evicted = _pressure(neg, kv, rounds=30, seed=100)
    assert evicted > 40  # the whole pool turned over meanwhile
    kv.write(out.lease.block_table, prompt, out.reply.matched_tokens)  # the suffix lands
    done = neg.complete(out.reply.lease_id)
    assert kv.read(done.block_table, 40) == [t * 1000 + i for i, t in enumerate(prompt)]
    assert before == kv.read(done.block_table, 32)
    neg.finish(done)
    neg.cache.validate()


def test_without_a_pin_the_race_is_real() -> None:
    """Control: a plain lookup (no lease) loses its pages to the same pressure."""
    neg = md(num_pages=40, budget=24)
    kv = KVStore(40)
    prompt = toks(32, seed=42)
    first = neg.handle_query(make_query(1, prompt, P), 0.0)
    assert first.lease is not None
    kv.write(first.lease.block_table, prompt, 0)
    neg.finish(neg.complete(first.reply.lease_id))
    m = neg.cache.lookup(prompt)
    assert m.num_tokens == 32
    _pressure(neg, kv, rounds=30, seed=100)
    assert kv.read(m.pages, 32) != [t * 1000 + i for i, t in enumerate(prompt)]


def test_negotiator_needs_an_allocator() -> None:
    with pytest.raises(InvalidArgument):
        PrefixNegotiator(RadixCache(P))


# ---- codec round trip over arbitrary valid messages ------------------------------
u64 = st.integers(0, (1 << 64) - 1)
u32 = st.integers(0, (1 << 32) - 1)


@st.composite
def queries(draw: st.DrawFn) -> PrefixQuery:
    pt = draw(st.integers(1, 128))
    n = draw(st.integers(0, 64))
    ntok = draw(st.integers(n * pt, n * pt + pt - 1))
    hashes = tuple(draw(st.lists(st.binary(min_size=16, max_size=16), min_size=n, max_size=n)))
    return PrefixQuery(draw(u64), ntok, pt, hashes, draw(u32))


replies = st.builds(
    lambda rid, pt, lease, pages, ms, tok: PrefixReply(
        rid, ReplyStatus.OK, pt, lease, pages * pt if pages * pt < 1 << 32 else 0, ms, tok
    ),
    u64,
    st.integers(1, 2**32 - 1),
    u64,
    st.integers(0, 1 << 20),
    u32,
    st.binary(max_size=600),
)
cancels = st.builds(PrefixCancel, u64, u64, st.sampled_from(list(CancelReason)))


@given(st.one_of(queries(), replies, cancels))
def test_codec_round_trip(msg: PrefixQuery | PrefixReply | PrefixCancel) -> None:
    ftype, payload = encode_prefix_message(msg)
    assert decode_prefix_message(ftype, payload) == msg
    # every strict prefix of a payload is rejected, never misread
    for cut in {0, 1, len(payload) // 2, len(payload) - 1}:
        if cut < len(payload):
            with pytest.raises(RemoteProtocolError):
                decode_prefix_message(ftype, payload[:cut])


def test_contradictory_hashes_are_served_uncached() -> None:
    """A prefill whose hashes do not chain cannot corrupt the tree; its
    request still completes from its own pages."""
    neg = md()
    good = toks(8)
    neg.finish(neg.complete(neg.handle_query(make_query(1, good, P), 0.0).reply.lease_id))
    h = neg.cache.hashes(good)
    bad = PrefixQuery(2, 12, P, (b"\x07" * 16, h[1], b"\x08" * 16))  # h[1] under a wrong parent
    out = neg.handle_query(bad, 0.0)
    assert out.lease is not None and out.reply.matched_tokens == 0
    done = neg.complete(out.reply.lease_id)
    assert done.block_table == out.lease.block_table and done.owned_pages == out.lease.fresh_pages
    neg.finish(done)
    neg.cache.validate()
    assert neg.cache.cached_pages == 2
    assert neg.cache.allocator is not None and neg.cache.allocator.used_count == 2
