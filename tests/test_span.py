"""KVSpan: one checked value for (block table, tokens, layers, heads).

The type itself (every bad part refused with its typed error, the table
copied once and read-only, immutability, equality and hashing by value,
the check against a cache), and the public calls that take the five loose
values taking a span in their place with the same result: pack / unpack,
``PagedKVCache.range`` and ``KVRange``, the TCP sources and sinks, the
bridges' ``expect`` and ``send`` (TCP and UCX), the UCX agent's verbs."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbridge
from kvbridge.errors import (
    DTypeError,
    InvalidArgument,
    LayoutError,
    PageIndexError,
    ShapeError,
)
from kvbridge.layout import KVLayout
from kvbridge.span import KVSpan, as_span

pytest.importorskip("kvbridge._core")
from kvbridge import pack
from kvbridge.bridge import PeerConfig
from kvbridge.bridge.sync import SyncBridge
from kvbridge.transport import ucx
from kvbridge.transport.tcp.kvio import KVSink, KVSource

L = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)
MODEL = "SmolLM2-135M-Instruct"
needs_ucx = pytest.mark.skipif(not ucx.available(), reason="UCX unavailable")


# ---- the type ----------------------------------------------------------------------------------
def test_exported_from_kvbridge() -> None:
    assert kvbridge.KVSpan is KVSpan
    assert "KVSpan" in kvbridge.__all__


@pytest.mark.parametrize(
    ("args", "kw", "err"),
    [
        (([1, 2], 5, 3), {}, InvalidArgument),  # reversed tokens
        (([1, 2], -1, 3), {}, InvalidArgument),
        (([1, 2], 0.0, 3), {}, InvalidArgument),  # not an int
        (([1, 2], True, 3), {}, InvalidArgument),  # a bool is not a token index
        (([1, 2], 0, "3"), {}, InvalidArgument),
        (([1, 2], 0, 3), {"layers": (2, 1)}, LayoutError),
        (([1, 2], 0, 3), {"layers": (-1, 1)}, LayoutError),
        (([1, 2], 0, 3), {"layers": (0,)}, LayoutError),
        (([1, 2], 0, 3), {"layers": (0, 1.5)}, LayoutError),
        (([1, 2], 0, 3), {"heads": (1, 1)}, LayoutError),  # empty
        (([1, 2], 0, 3), {"heads": (2, 1)}, LayoutError),
        (([[1, 2], [3, 4]], 0, 3), {}, ShapeError),
        (([1.0, 2.0], 0, 3), {}, DTypeError),
        ((["a", "b"], 0, 3), {}, DTypeError),
        (([2**31], 0, 3), {}, PageIndexError),
        (([-(2**31) - 1], 0, 3), {}, PageIndexError),
        ((object(), 0, 3), {}, InvalidArgument),
    ],
)
def test_bad_parts_are_refused_with_their_typed_error(
    args: tuple[Any, ...], kw: dict[str, Any], err: type[Exception]
) -> None:
    with pytest.raises(err):
        KVSpan(*args, **kw)


def test_a_float_tensor_is_refused() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(DTypeError):
        KVSpan(torch.zeros(4), 0, 16)


def test_the_table_is_copied_once_and_read_only() -> None:
    table = np.array([5, 6, 7], dtype=np.int64)
    span = KVSpan(table, 0, 40)
    table[0] = 99  # the engine reuses its table: the span keeps what it was given
    assert span.block_table.tolist() == [5, 6, 7]
    assert span.block_table.dtype == np.int32 and span.block_table.flags.c_contiguous
    with pytest.raises(ValueError):
        span.block_table[0] = 1
    same = np.array([5, 6, 7], dtype=np.int32)
    assert not np.shares_memory(KVSpan(same, 0, 40).block_table, same)  # even int32 is copied


def test_immutable_and_replace_shares_the_pages() -> None:
    span = KVSpan([1, 2, 3, 4], 0, 64, layers=(0, 4))
    for name, value in [("start", 1), ("end", 2), ("layers", None), ("heads", (0, 1))]:
        with pytest.raises(AttributeError):
            setattr(span, name, value)
    with pytest.raises(AttributeError):
        del span.start
    part = span.replace(start=16, layers=(1, 2), heads=(0, 1))
    assert (part.start, part.end, part.layers, part.heads) == (16, 64, (1, 2), (0, 1))
    assert part.block_table is span.block_table  # shared, not copied
    assert span.layers == (0, 4) and span.heads is None  # the original is unchanged
    assert part.replace(layers=KVSpan.ALL).layers is None
    with pytest.raises(InvalidArgument):
        span.replace(start=65)
    with pytest.raises(LayoutError):
        span.replace(heads=(1, 1))


def test_equality_and_hash_by_value() -> None:
    a = KVSpan([1, 2, 3], 0, 40, layers=(0, 2))
    b = KVSpan(np.array([1, 2, 3], dtype=np.int64), 0, 40, layers=(0, 2))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != KVSpan([1, 2, 4], 0, 40, layers=(0, 2))
    assert a != a.replace(end=39)
    assert a != a.replace(layers=KVSpan.ALL)
    assert a != a.replace(heads=(0, 1))
    assert a != (a.block_table, 0, 40)
    assert pickle.loads(pickle.dumps(a)) == a
    assert KVSpan(a, 0, 40, layers=(0, 2)) == a  # a span's table as the table


def test_check_against_a_cache() -> None:
    cache = pack.PagedKVCache.allocate(L, 8)
    ok = KVSpan([7, 0, 3, -1], 0, 48)  # the entry past the range is not looked at
    got = ok.check(cache)
    assert (got.layers, got.heads) == ((0, 4), (0, 2))
    assert got == ok.resolve(L)
    with pytest.raises(PageIndexError):
        KVSpan([7, 8], 0, 32).check(cache)  # page 8 of 8
    with pytest.raises(PageIndexError):
        KVSpan([7, -1], 0, 32).check(cache)
    with pytest.raises(PageIndexError):
        KVSpan([7], 0, 17).check(cache)  # the table does not cover token 16
    with pytest.raises(LayoutError):
        KVSpan([1], 0, 16, layers=(0, 5)).check(cache)
    with pytest.raises(LayoutError):
        KVSpan([1], 0, 16, heads=(1, 3)).check(cache)
    # against a layout alone: pages of page_tokens, entries only non-negative
    assert KVSpan([100, 200], 0, 32).check(L).layers == (0, 4)
    with pytest.raises(PageIndexError):
        KVSpan([100, -2], 0, 32).check(L)
    # a cache of 32-token blocks counts its table in blocks of two pages
    big = pack.PagedKVCache(L, cache.tensors, block_tokens=32)
    KVSpan([3, 0], 0, 64).check(big)
    with pytest.raises(PageIndexError):
        KVSpan([4], 0, 32).check(big)  # blocks [0, 4)


def test_as_span_takes_one_form_or_the_other() -> None:
    span = KVSpan([1], 0, 16)
    assert as_span(span) is span
    assert as_span([1], 0, 16) == span
    with pytest.raises(InvalidArgument, match="not both"):
        as_span(span, 0, 16)
    with pytest.raises(InvalidArgument, match="not both"):
        as_span(span, layers=(0, 1))
    with pytest.raises(InvalidArgument, match="start and end"):
        as_span([1], 0)


@settings(max_examples=60, deadline=None)
@given(
    table=st.lists(st.integers(0, 2**31 - 1), max_size=12),
    start=st.integers(0, 200),
    n=st.integers(0, 200),
    layers=st.none() | st.tuples(st.integers(0, 4), st.integers(0, 4)).map(sorted).map(tuple),
)
def test_property_any_form_of_a_table_makes_the_same_span(
    table: list[int], start: int, n: int, layers: tuple[int, int] | None
) -> None:
    torch = pytest.importorskip("torch")
    spans = [
        KVSpan(table, start, start + n, layers=layers),
        KVSpan(np.array(table, dtype=np.int64), start, start + n, layers=layers),
        KVSpan(torch.tensor(table, dtype=torch.int64), start, start + n, layers=layers),
        KVSpan(tuple(table), start, start + n, layers=layers),
    ]
    assert all(s == spans[0] and hash(s) == hash(spans[0]) for s in spans)
    s = spans[0]
    assert s.block_table.tolist() == table
    assert s.replace() == s and pickle.loads(pickle.dumps(s)) == s
    first, last = start // 16, (start + n - 1) // 16
    if n == 0:
        assert s.pages(16).size == 0
    elif last < len(table):
        assert s.pages(16).tolist() == table[first : last + 1]
    else:
        with pytest.raises(PageIndexError):
            s.pages(16)


# ---- the pack API ----------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    start=st.integers(0, 100),
    n=st.integers(0, 90),
    layers=st.tuples(st.integers(0, 4), st.integers(0, 4)).map(sorted).map(tuple),
    seed=st.integers(0, 2**16),
)
def test_property_pack_of_a_span_equals_pack_of_the_five(
    start: int, n: int, layers: tuple[int, int], seed: int
) -> None:
    cache = _CACHE
    rng = np.random.default_rng(seed)
    table = rng.permutation(cache.num_pages)[: L.pages_for(start + n)]
    span = KVSpan(table, start, start + n, layers=layers)
    loose = pack.pack(cache, table, start, start + n, layers=layers)
    assert bytes(pack.pack(cache, span)) == bytes(loose)
    assert bytes(pack.KVRange(cache, span).pack()) == bytes(loose)
    assert bytes(cache.range(span, writable=False).pack()) == bytes(loose)


_CACHE = pack.PagedKVCache.allocate(L, 16, fill="random", seed=3)


def test_unpack_takes_a_span_and_kvrange_keeps_it() -> None:
    src = pack.PagedKVCache.allocate(L, 8, fill="random", seed=5)
    a, b = pack.PagedKVCache.allocate(L, 8), pack.PagedKVCache.allocate(L, 8)
    table = [3, 1, 6]
    span = KVSpan(table, 5, 40, layers=(1, 3), heads=(1, 2))
    wire = pack.pack(src, span)
    pack.unpack(a, span, wire)
    pack.unpack(b, table, 5, 40, wire, layers=(1, 3), heads=(1, 2))
    assert bytes(pack.pack(a, span)) == bytes(wire) == bytes(pack.pack(b, span))
    assert bytes(pack.pack(a, table, 0, 48)) == bytes(pack.pack(b, table, 0, 48))
    rng = pack.KVRange(a, span)
    assert rng.span == span.resolve(L) and (rng.start, rng.end, rng.layers, rng.heads) == (
        5,
        40,
        (1, 3),
        (1, 2),
    )
    with pytest.raises(InvalidArgument, match="not both"):
        pack.KVRange(a, span, 5, 40)
    with pytest.raises(InvalidArgument, match="needs src"):
        pack.unpack(a, span)
    with pytest.raises(PageIndexError):
        pack.pack(a, KVSpan([9], 0, 16))


def test_tcp_sources_and_sinks_take_a_span() -> None:
    src = pack.PagedKVCache.allocate(L, 8, fill="random", seed=9)
    span = KVSpan([2, 4, 6], 3, 40, layers=(0, 2))
    a, b = KVSource(src, span), KVSource(src, [2, 4, 6], 3, 40, (0, 2))
    assert (a.nbytes, a.token_range, a.layer_range, a.heads, a.layout_hash) == (
        b.nbytes,
        b.token_range,
        b.layer_range,
        b.heads,
        b.layout_hash,
    )
    assert a.span == span.resolve(L)
    out_a, out_b = bytearray(a.nbytes), bytearray(b.nbytes)
    a.read_into(0, memoryview(out_a))
    b.read_into(0, memoryview(out_b))
    assert out_a == out_b
    assert KVSink(pack.PagedKVCache.allocate(L, 8), span).nbytes == a.nbytes


# ---- the bridges ---------------------------------------------------------------------------
def _poll(b: SyncBridge, want: str, n: int, timeout: float = 20) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while True:
        ev = b.poll()
        assert not ev.failed, ev.failed
        got += getattr(ev, want)
        if len(got) >= n:
            return got
        assert time.monotonic() < deadline, f"{want}: {got}"
        time.sleep(0.005)


def _digest(cache: pack.PagedKVCache, span: KVSpan) -> str:
    return hashlib.sha256(bytes(pack.pack(cache, span))).hexdigest()


def test_sync_bridge_expect_and_send_take_a_span_over_tcp() -> None:
    src = pack.PagedKVCache.allocate(L, 64, fill="random", seed=1)
    dst = pack.PagedKVCache.allocate(L, 64)
    md = SyncBridge(dst, identity="md", model_id=MODEL, tcp_listen=("127.0.0.1", 0)).start()
    pre = SyncBridge(src, identity="p", model_id=MODEL).start()
    try:
        pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port))
        n = 100
        ours = KVSpan(list(range(10, 10 + L.pages_for(n))), 0, n)
        theirs = KVSpan(list(range(30, 30 + L.pages_for(n))), 0, n, layers=(1, 3))
        pre.send("a", ours, {"md": md.expect("a", theirs)})  # both calls: spans
        pre.send("b", list(ours.block_table), {"md": md.expect("b", theirs.block_table, 0, n,
                                                                 layers=(1, 3))})  # fmt: skip
        _poll(md, "received", 2)
        assert {d.request_id for d in _poll(pre, "sent", 2)} == {"a", "b"}
        assert _digest(dst, theirs) == _digest(src, ours.replace(layers=(1, 3)))
        # a span given to send bounds what a ticket may ask for: refused before anything moves
        short = ours.replace(end=50)
        with pytest.raises(InvalidArgument, match="outside the span"):
            pre.send("c", short, {"md": md.expect("c", theirs)})
        assert pre.pending == ([], [])
        with pytest.raises(InvalidArgument, match="not both"):
            md.expect("d", theirs, 0, n)
    finally:
        pre.close()
        md.close()


@needs_ucx
def test_sync_bridge_and_ucx_verbs_take_a_span() -> None:
    src = pack.PagedKVCache.allocate(L, 64, fill="random", seed=2)
    dst = pack.PagedKVCache.allocate(L, 64)
    rld = SyncBridge(dst, identity="rld", model_id=MODEL, ucx=True).start()
    pre = SyncBridge(src, identity="p", model_id=MODEL, ucx=True).start()
    try:
        pre.connect("rld", PeerConfig("ucx", metadata=rld.ucx_metadata()))
        n = 90
        ours = KVSpan(list(range(5, 5 + L.pages_for(n))), 0, n)
        theirs = KVSpan(list(range(40, 40 + L.pages_for(n))), 0, n)
        pre.send("u", ours, {"rld": rld.expect("u", theirs, via="ucx")})
        _poll(rld, "received", 1)
        _poll(pre, "sent", 1)
        assert _digest(dst, theirs) == _digest(src, ours)
    finally:
        pre.close()
        rld.close()


@needs_ucx
def test_ucx_agent_expect_and_peer_send_take_a_span() -> None:
    async def body() -> None:
        src = pack.PagedKVCache.allocate(L, 32, fill="random", seed=4)
        dst = pack.PagedKVCache.allocate(L, 32)
        a = ucx.UcxAgent(L, src, allow_unauthenticated=True)
        b = ucx.UcxAgent(L, dst, allow_unauthenticated=True)
        a.start()
        b.start()
        try:
            peer = await a.connect(b.metadata())
            ours, theirs = KVSpan([1, 2, 3], 4, 40), KVSpan([9, 8, 7], 4, 40)
            heads = KVSpan([11, 12], 0, 20, heads=(1, 2))  # a head range goes staged
            hs = [b.expect("x", theirs), b.expect("y", heads, timeout=10)]
            ss = [
                peer.send("x", ours, theirs.block_table),
                peer.send("y", heads, heads.block_table, path="staging"),
            ]
            for h in ss + hs:
                await h.wait(10)
            assert _digest(dst, theirs) == _digest(src, ours)
            assert _digest(dst, heads) == _digest(src, heads)
            with pytest.raises(InvalidArgument, match="not both"):
                peer.send("z", ours, theirs.block_table, 4, 40)
            prepared = peer.prepare_send(ours, theirs.block_table)
            assert prepared is not None
        finally:
            await a.close()
            await b.close()

    asyncio.run(asyncio.wait_for(body(), 60))
