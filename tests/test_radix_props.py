"""Property tests of the radix cache against a model dict (hypothesis)."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbridge.cache import OutOfPages, PageAllocator, Pin, RadixCache

P = 2
NUM_PAGES = 24
# tiny alphabet and short sequences so that prefixes are shared often
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=5 * P + 1)


class RecordingAllocator(PageAllocator):
    """Records what the cache frees (its evictions); the test frees with
    ``give_back`` so that its own frees are not mistaken for evictions."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.evicted: list[int] = []

    def free(self, pages: Iterable[int]) -> None:
        batch = list(pages)
        super().free(batch)
        self.evicted.extend(batch)

    def give_back(self, pages: list[int]) -> None:
        super().free(pages)


class RadixModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = RecordingAllocator(NUM_PAGES)
        self.cache = RadixCache(P, allocator=self.alloc, budget_pages=16)
        # model: full-page prefix (tuple of tokens) -> page id holding it
        self.model: dict[tuple[int, ...], int] = {}
        self.pins: list[tuple[Pin, list[tuple[int, ...]]]] = []

    def _prefixes(self, toks: list[int]) -> list[tuple[int, ...]]:
        return [tuple(toks[: (i + 1) * P]) for i in range(len(toks) // P)]

    def _forget(self, evicted: list[int]) -> None:
        pinned = {self.model[k] for _, keys in self.pins for k in keys}
        assert not pinned & set(evicted), "a pinned page was evicted"
        gone = set(evicted)
        self.model = {k: v for k, v in self.model.items() if v not in gone}

    def _sync_evictions(self) -> None:
        self._forget(self.alloc.evicted)
        self.alloc.evicted = []

    @rule(toks=tokens_st, pin=st.booleans())
    def insert(self, toks: list[int], pin: bool) -> None:
        keys = self._prefixes(toks)
        m = self.cache.lookup(toks)
        hold = self.cache.pin(m)  # keep the matched prefix while allocating
        need = len(keys) - m.num_pages + (1 if len(toks) % P else 0)
        try:
            fresh = self.cache.allocate(need)
        except OutOfPages:
            self.cache.release(hold)
            self._sync_evictions()
            return
        self._sync_evictions()
        table = list(m.pages) + fresh
        r = self.cache.insert(toks, table, pin=pin)
        self.cache.release(hold)
        for k, page in zip(keys, r.pages, strict=True):
            if k in self.model:
                assert self.model[k] == page
            self.model[k] = page
        self.alloc.give_back(list(r.duplicates) + list(r.uncached))
        self._sync_evictions()
        if r.pin is not None:
            self.pins.append((r.pin, keys))

    @rule(toks=tokens_st)
    def lookup(self, toks: list[int]) -> None:
        m = self.cache.lookup(toks)
        keys = self._prefixes(toks)
        expect: list[int] = []
        for k in keys:
            if k not in self.model:
                break
            expect.append(self.model[k])
        assert list(m.pages) == expect
        assert m.num_tokens == len(expect) * P

    @rule(toks=tokens_st)
    def pin_lookup(self, toks: list[int]) -> None:
        m = self.cache.lookup(toks)
        self.pins.append((self.cache.pin(m), self._prefixes(toks)[: m.num_pages]))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        pin, _ = self.pins.pop(i % len(self.pins))
        self.cache.release(pin)  # may evict down to the budget
        self._sync_evictions()

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_pages
        got = self.cache.evict(n)
        assert len(got) == min(n, before)
        assert self.alloc.evicted == got
        self._sync_evictions()

    @invariant()
    def consistent(self) -> None:
        self.cache.validate()
        assert self.cache.cached_pages == len(self.model)
        assert self.cache.cached_pages <= 16 or self.cache.evictable_pages == 0
        # pages are either free, cached, or nowhere (never both free and cached)
        assert self.alloc.used_count == self.cache.cached_pages


RadixModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixModel = RadixModel.TestCase
