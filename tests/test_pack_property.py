"""Property tests: random layouts, ranges, block tables and slices agree with
the torch reference, and chunked unpack in any order rebuilds the range."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.layout import KVLayout
from kvbridge.pack import HAS_CORE, PagedKVCache, pack, unpack
from kvbridge.testing.pack_ref import ref_pack

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    mla = draw(st.booleans())
    return KVLayout(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=1 if mla else draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([1, 2, 3, 8, 16, 24])),
        dtype=draw(st.sampled_from(["fp32", "fp16", "bf16", "fp8_e4m3"])),
        page_tokens=draw(st.integers(1, 20)),
        order=draw(st.sampled_from(["kv_first", "page_first"])),
        head_order="NHD" if mla else draw(st.sampled_from(["NHD", "HND"])),
        stacked=draw(st.booleans()),
        mla=mla,
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[KVLayout, KVLayout, int, int, tuple[int, int], int]:
    send = draw(layouts())
    recv = KVLayout(
        num_layers=send.num_layers,
        num_kv_heads=send.num_kv_heads,
        head_dim=send.head_dim,
        dtype=send.dtype,
        page_tokens=draw(st.integers(1, 20)),
        order=draw(st.sampled_from(["kv_first", "page_first"])),
        head_order="NHD" if send.mla else draw(st.sampled_from(["NHD", "HND"])),
        stacked=draw(st.booleans()),
        mla=send.mla,
    )
    start = draw(st.integers(0, 60))
    end = draw(st.integers(start, start + 70))
    l0 = draw(st.integers(0, send.num_layers))
    l1 = draw(st.integers(l0, send.num_layers))
    return send, recv, start, end, (l0, l1), draw(st.integers(0, 2**31))


@SETTINGS
@given(cases())
def test_random_layouts_round_trip(
    case: tuple[KVLayout, KVLayout, int, int, tuple[int, int], int],
) -> None:
    send, recv, start, end, layers, seed = case
    rng = np.random.default_rng(seed)
    blocks = send.pages_for(end)
    pool = blocks + int(rng.integers(0, 4))
    bt = rng.permutation(pool)[:blocks]
    sender = PagedKVCache.allocate(send, pool, fill="random", seed=seed)
    wire = pack(sender, bt, start, end, layers=layers)
    ref = ref_pack(sender, bt, start, end, layers).numpy()
    np.testing.assert_array_equal(wire, ref)

    # Any slice packs to the matching bytes.
    a = int(rng.integers(0, ref.nbytes + 1))
    b = int(rng.integers(a, ref.nbytes + 1))
    part = pack(sender, bt, start, end, layers=layers, offset=a, nbytes=b - a)
    np.testing.assert_array_equal(part, ref[a:b])

    # Chunked unpack, shuffled, into the receiver's layout.
    rblocks = recv.pages_for(end)
    rbt = rng.permutation(rblocks + 1)[:rblocks]
    receiver = PagedKVCache.allocate(recv, rblocks + 1, backend="torch")
    cuts = sorted({0, ref.nbytes, *rng.integers(0, ref.nbytes + 1, size=4).tolist()})
    pieces = list(itertools.pairwise(cuts))
    rng.shuffle(pieces)
    for lo, hi in pieces:
        unpack(receiver, rbt, start, end, ref[lo:hi], layers=layers, offset=lo)
    np.testing.assert_array_equal(ref_pack(receiver, rbt, start, end, layers).numpy(), ref)
