"""Huge pages under a host KV cache: ``advise_huge_pages`` keeps every byte,
reports what the kernel did, and refuses what it cannot do with a typed
error."""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np
import pytest

from kvbridge._pack import memory
from kvbridge._pack.memory import (
    HUGE_PAGE,
    advise_huge_pages,
    advise_spans,
    huge_page_bytes,
    merged_spans,
    spans_huge_page_bytes,
    thp_setting,
)
from kvbridge.errors import InvalidArgument, Unavailable
from kvbridge.pack import HAS_CORE, PagedKVCache

HAS_THP = thp_setting() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not HAS_THP, reason="no transparent huge pages on this system")


def test_merged_spans() -> None:
    assert merged_spans([(10, 20), (0, 5), (5, 8), (15, 30), (40, 40)]) == [(0, 8), (10, 30)]
    assert merged_spans([]) == []


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="needs nbytes"):
        advise_huge_pages(4096)
    if HAS_THP:
        with pytest.raises(InvalidArgument, match=">= 0"):
            advise_huge_pages(4096, -1)


def test_no_thp_is_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setattr(memory, "_THP_SETTING", "/nonexistent/thp")
    with pytest.raises(Unavailable, match="no transparent huge pages"):
        advise_huge_pages(np.zeros(4 * HUGE_PAGE, np.uint8))


def _settled(*reads: Callable[[], int], tries: int = 50) -> list[int]:
    """Readings of smaps taken while nothing moved under them.  ``khugepaged``
    collapses a marked range in its own time, so two readings taken a moment
    apart may differ (CI on a 2-core AMD EPYC VM saw one more huge page in
    the second).  Takes every reading, then the first again, until the first
    gives the same both times; huge pages under a marked range only grow, so
    the readings between agree with it then."""
    for _ in range(tries):
        got = [r() for r in reads]
        if reads[0]() == got[0]:
            return got
    pytest.fail(f"the huge pages under the buffers kept changing over {tries} readings")


def _vmstat(key: str) -> int:
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except OSError:
        pass
    return 0


@needs_thp
def test_marked_range_faults_in_huge_pages() -> None:
    """A fresh mapping marked before its first touch is faulted in on huge
    pages (any kernel with THP), and only the frames inside it are advised."""
    n = 8 * HUGE_PAGE
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)
    assert huge_page_bytes(a) == 0
    advise_huge_pages(a, collapse=False)
    fallbacks = _vmstat("thp_fault_fallback")
    a[:] = 7  # first touch
    got = huge_page_bytes(a)
    if got == 0 and _vmstat("thp_fault_fallback") > fallbacks:
        pytest.skip("the kernel had no free 2 MiB frames (thp_fault_fallback rose)")
    assert HUGE_PAGE <= got <= a.nbytes and got % HUGE_PAGE == 0
    assert int(a.sum(dtype=np.int64)) == 7 * a.nbytes
    del a
    m.close()


@needs_thp
def test_collapse_keeps_every_byte() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, 6 * HUGE_PAGE + 12345, dtype=np.uint8)
    before = a.copy()
    got, now = _settled(lambda: advise_huge_pages(a), lambda: huge_page_bytes(a))
    assert 0 <= got <= a.nbytes
    assert got == now
    np.testing.assert_array_equal(a, before)


@needs_thp
def test_spans_are_advised_and_read_together() -> None:
    """Several buffers at once: every byte kept, and one reading of smaps
    over all of them says what reading it for each says."""
    rng = np.random.default_rng(2)
    bufs = [rng.integers(0, 256, k * HUGE_PAGE + 999, dtype=np.uint8) for k in (3, 5)]
    before = [b.copy() for b in bufs]
    spans = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in bufs]
    got, together, each = _settled(
        lambda: advise_spans(spans),
        lambda: spans_huge_page_bytes(spans),
        lambda: sum(huge_page_bytes(b) for b in bufs),
    )
    assert 0 <= got <= sum(b.nbytes for b in bufs)
    assert got == together == each
    for b, old in zip(bufs, before, strict=True):
        np.testing.assert_array_equal(b, old)
    with pytest.raises(InvalidArgument, match="ends before it starts"):
        advise_spans([(10, 5)])


@pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")
def test_cache_advise_keeps_what_pack_reads() -> None:
    torch = pytest.importorskip("torch")
    from kvbridge.testing.engine_caches import random_fill, vllm_kv_caches

    caches = vllm_kv_caches(
        num_layers=3, num_blocks=64, num_kv_heads=3, block_size=16, head_size=64,
        dtype=torch.bfloat16, layout="LBHNC",
    )  # fmt: skip
    flat = random_fill(caches)
    cache = PagedKVCache.from_vllm(caches)
    # one flat buffer: the spans are exactly its bytes
    (span,) = cache.memory_spans()
    assert span == (flat.data_ptr(), flat.data_ptr() + flat.numel())
    bt = np.random.default_rng(0).permutation(64)[:20].astype(np.int32)
    rng = cache.range(bt, 5, 20 * 16 - 3)
    before = rng.pack()
    try:
        got, now = _settled(cache.advise_huge_pages, cache.huge_page_bytes)
    except Unavailable:
        pytest.skip("no transparent huge pages on this system")
    assert got == now and 0 <= got <= flat.numel()
    np.testing.assert_array_equal(rng.pack(), before)


def test_connector_setting() -> None:
    from kvbridge.integrations.vllm.config import ConnectorConfig

    on = ConnectorConfig.from_extra({}, engine_id="e", model="m")
    off = ConnectorConfig.from_extra({"huge_pages": False}, engine_id="e", model="m")
    assert on.huge_pages and not off.huge_pages
