"""The pure-Python fleet router as it was before its state and choices moved
to the compiled core (kvbridge/fleet/core.py at commit 73237c8, unchanged
below this paragraph but for ``prefilled``, added later in both with its
effect on ``finish`` and on a prefill's re-routes): tests/test_fleet_router.py
holds the compiled one to every decision of this one.

The fleet router core, sans-IO.

Fed by registry view changes (:meth:`FleetRouter.apply`), it chooses per
request a prefill (least queued work, less what its own prefix cache holds),
the pipeline (``kvbridge.router.Router``: P-MD or P-RLD-MD), a relay when the
pipeline has one (least load) and a main decode: the one holding the longest
prefix of the request (the prefixes routed there, and those its load reports
list), among those not above their share of the requests in flight by more
than ``load_factor``; a session keeps its main decode while that holds.
Engines whose lease ends or whose requests fail ``max_failures`` times in a
row are ejected, and taken back when they register again (a new generation).

Cost per request is O(pages + log engines), independent of the fleet's size
in the common case: each engine owns a bit (``_Engine.bit``), the prefix
index maps a page hash to the bit set of the engines holding it (a plain
``int``, so the index holds no objects for the garbage collector to walk),
and the least-loaded engine of each role comes from a lazily updated heap.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbridge.cache.hashing import page_hashes
from kvbridge.errors import InvalidArgument, Unavailable
from kvbridge.registry.records import EngineRecord, Role
from kvbridge.registry.view import ViewChange
from kvbridge.router import Decision, Pipeline, Reason, Router

__all__ = ["FleetConfig", "FleetRoute", "FleetRouter", "Reroute"]

_ROLES = (Role.PREFILL, Role.RELAY, Role.MAIN)


@dataclass(frozen=True)
class FleetConfig:
    page_tokens: int = 16
    load_factor: float = 1.5  # no main decode above its share by more than this
    max_failures: int = 3  # consecutive failed requests before an engine is ejected
    max_pages_per_engine: int = 65536  # prefix index entries kept per engine (LRU)

    def __post_init__(self) -> None:
        if self.page_tokens < 1 or self.load_factor < 1 or self.max_failures < 1:
            raise InvalidArgument("page_tokens >= 1, load_factor >= 1, max_failures >= 1")


@dataclass(frozen=True)
class FleetRoute:
    request_id: str
    prefill: str
    relay: str | None
    main: str
    matched_tokens: int  # what the chosen main decode is expected to hold
    decision: Decision


@dataclass(frozen=True)
class Reroute:
    """What to do with a request in flight on an engine that died."""

    request_id: str
    stage: str  # "prefill": prefill it again on ``engine``; "main": continue on ``engine``
    engine: str


@dataclass(eq=False)
class _Engine:
    engine_id: str
    record: EngineRecord
    bit: int  # 1 << slot
    pages: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    active: int = 0  # requests in flight on it (any stage)
    routed_tokens: int = 0  # prompt tokens of the requests in flight it prefills
    failures: int = 0
    ejected: bool = False
    roles: tuple[Role, ...] = ()  # the roles it serves
    queued: int = 0  # prefill work ahead of a new request: reported queue + routed tokens

    def __post_init__(self) -> None:
        self.update(self.record)

    def update(self, record: EngineRecord) -> None:
        self.record = record
        self.roles = tuple(r for r in _ROLES if record.role.serves(r))
        self.queued = record.load.queued_tokens + self.routed_tokens

    def key(self, role: Role) -> tuple[int, int]:
        """Its load as the heap of ``role`` orders it (lower is better)."""
        if role is Role.PREFILL:
            return (self.queued, 0)
        load = self.record.load
        if role is Role.RELAY:
            return (self.active + load.active_transfers, load.queued_tokens)
        return (self.active, 0)


class _LoadHeap:
    """The least-loaded eligible engine of one role: a heap of (key, seq,
    engine) entries, pushed at every change of an engine's key and checked
    when read (an entry whose key is no longer the engine's is dropped)."""

    def __init__(self, role: Role, members: dict[str, _Engine]) -> None:
        self.role = role
        self.members = members  # the eligible engines of the role
        self._heap: list[tuple[tuple[int, int], int, _Engine]] = []
        self._seq = itertools.count()

    def push(self, eng: _Engine) -> None:
        heap = self._heap
        if len(heap) > 4 * len(self.members) + 64:  # mostly stale entries: start afresh
            heap[:] = [(e.key(self.role), next(self._seq), e) for e in self.members.values()]
            heapq.heapify(heap)
        heapq.heappush(heap, (eng.key(self.role), next(self._seq), eng))

    def top(self) -> _Engine | None:
        heap, members = self._heap, self.members
        while heap:
            key, _, eng = heap[0]
            if members.get(eng.engine_id) is eng and key == eng.key(self.role):
                return eng
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        return len(self._heap)


class FleetRouter:
    def __init__(self, router: Router, config: FleetConfig | None = None) -> None:
        self.router = router
        self.config = config or FleetConfig()
        self._engines: dict[str, _Engine] = {}
        self._by_bit: dict[int, _Engine] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._holders: dict[bytes, int] = {}  # page hash -> bits of the engines holding it
        # the eligible (not ejected) engines serving each role, and their bits
        self._members: dict[Role, dict[str, _Engine]] = {r: {} for r in _ROLES}
        self._mask: dict[Role, int] = dict.fromkeys(_ROLES, 0)
        # the least loaded prefill and relay (main decodes: ``_by_active``)
        self._heaps = {r: _LoadHeap(r, self._members[r]) for r in (Role.PREFILL, Role.RELAY)}
        self._active_total = 0  # requests in flight on eligible main decodes
        self._by_active: dict[int, int] = {}  # requests in flight -> bits of those main decodes
        self._turn = 0  # ties go round: the first candidate bit at or above this slot
        self._sessions: dict[str, str] = {}
        self._inflight: dict[str, FleetRoute] = {}
        self._routed: dict[str, int] = {}  # request -> its prompt tokens
        self._prefilled: set[str] = set()  # requests whose prompt left their prefill's queue

    # --- the view's feed ----------------------------------------------------
    def apply(self, change: ViewChange) -> list[Reroute]:
        """A registry view change; returns the re-routing of requests in
        flight on an engine that left."""
        eid = change.engine_id
        if change.record is None:
            return self._lose(eid)
        eng = self._engines.get(eid)
        reroutes: list[Reroute] = []
        if eng is None or change.restarted:
            if eng is not None:
                reroutes = self._lose(eid)
            eng = self._add(eid, change.record)
        else:
            self._leave_roles(eng)
            eng.update(change.record)
            self._join_roles(eng)
        for h in change.record.prefixes:
            self._note(eng, h)
        return reroutes

    # --- routing -------------------------------------------------------------
    def route(
        self,
        request_id: str,
        tokens: Sequence[int],
        expected_output_tokens: int,
        *,
        session: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> FleetRoute:
        if request_id in self._inflight:
            raise InvalidArgument(f"request {request_id!r} is already routed")
        if hashes is None:
            hashes = page_hashes(tokens, self.config.page_tokens)
        pt = self.config.page_tokens
        levels = self._levels(hashes)
        main, main_pages = self._pick_main(levels, session)
        prefill, prefill_pages = self._pick_prefill(levels)
        n = len(tokens)
        matched = min(main_pages * pt, n)
        decision = self.router.decide(
            request_id, n, matched, expected_output_tokens,
            compute_tokens=n - min(prefill_pages * pt, n),
            queued_tokens=prefill.record.load.queued_tokens,
        )  # fmt: skip
        relay = None
        if decision.pipeline is Pipeline.P_RLD_MD:
            if self._members[Role.RELAY]:
                relay = self._least(Role.RELAY).engine_id
            else:  # no relay in the fleet: the main decode serves it alone
                decision = dataclasses.replace(
                    decision, pipeline=Pipeline.P_MD, reason=Reason.NO_RELAY
                )
        route = FleetRoute(request_id, prefill.engine_id, relay, main.engine_id, matched, decision)
        self._begin(route, n, hashes, main_pages, prefill_pages, session)
        return route

    def prefilled(self, request_id: str) -> None:
        """The request's prefill ended: its prompt tokens leave its prefill's
        queued work (added after commit 73237c8, as the compiled core has it)."""
        route = self._inflight.get(request_id)
        if route is None or request_id in self._prefilled:
            return
        self._prefilled.add(request_id)
        eng = self._engines.get(route.prefill)
        n = self._routed.get(request_id, 0)
        if eng is not None and n:
            self._load(eng, 0, -n)

    def finish(self, request_id: str, *, failed_on: str | None = None) -> None:
        """The request ended; ``failed_on``: the engine it failed on, if any."""
        route = self._inflight.pop(request_id, None)
        if route is None:
            return
        n = self._routed.pop(request_id, 0)
        if request_id in self._prefilled:
            self._prefilled.discard(request_id)
            n = 0
        for eid in {route.prefill, route.main, route.relay} - {None}:
            eng = self._engines.get(eid)  # type: ignore[arg-type]
            if eng is None:
                continue
            self._load(eng, -1, -n if eid == route.prefill else 0)
            if eid == failed_on:
                eng.failures += 1
                if eng.failures >= self.config.max_failures and not eng.ejected:
                    self._leave_roles(eng)
                    eng.ejected = True
            elif failed_on is None:
                eng.failures = 0

    def eligible(self, role: Role) -> list[str]:
        return list(self._members[role])

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # --- choices -------------------------------------------------------------
    def _levels(self, hashes: Sequence[bytes]) -> list[int]:
        """``levels[i]``: the bits of the engines holding the request's first
        ``i + 1`` pages (each level a subset of the one before)."""
        holders = self._holders
        levels: list[int] = []
        cand = -1
        for h in hashes:
            cand &= holders.get(h, 0)
            if not cand:
                break
            levels.append(cand)
        return levels

    def _pick_main(self, levels: list[int], session: str | None) -> tuple[_Engine, int]:
        members = self._members[Role.MAIN]
        if not members:
            raise Unavailable("no main decode in the fleet")
        cap = self.config.load_factor * (self._active_total + 1) / len(members)
        # the main decodes by requests in flight, least first; those within the cap
        buckets = sorted(self._by_active.items())
        fit = [(a, m) for a, m in buckets if a + 1 <= cap] or buckets  # none fits: all
        fit_mask = 0
        for _, m in fit:
            fit_mask |= m
        if session is not None:
            kept = members.get(self._sessions.get(session, ""))
            if kept is not None and kept.bit & fit_mask:
                return kept, _depth(levels, kept.bit)
        for i in range(len(levels) - 1, -1, -1):
            held = levels[i] & fit_mask
            if held:  # the deepest level held by one that fits: its least loaded
                return self._by_bit[self._next(_least_of(held, fit))], i + 1
        return self._by_bit[self._next(_least_of(fit_mask, fit))], 0

    def _next(self, tied: int) -> int:
        """One bit of ``tied`` (engines equal for the choice), in turn, so that
        new prefixes spread over equal engines instead of piling on one."""
        later = tied & ~((1 << self._turn) - 1)
        m = later or tied
        bit = m & -m
        self._turn = bit.bit_length()
        return bit

    def _pick_prefill(self, levels: list[int]) -> tuple[_Engine, int]:
        """Least queued work less what its prefix index holds: the deepest
        levels first, stopping when no shallower engine can do better than
        the best so far (the least-loaded engine bounds them)."""
        least = self._least(Role.PREFILL)
        floor = least.queued
        pt = self.config.page_tokens
        best, best_pages = least, _depth(levels, least.bit)
        best_w = floor - best_pages * pt
        mask = self._mask[Role.PREFILL]
        by_bit = self._by_bit
        seen = 0
        for i in range(len(levels) - 1, -1, -1):
            saved = (i + 1) * pt
            if best_w <= floor - saved:
                break  # nobody holding at most i + 1 pages beats it
            new = levels[i] & mask & ~seen
            while new:
                bit = new & -new
                new ^= bit
                eng = by_bit[bit]
                if eng.queued - saved < best_w:
                    best, best_pages, best_w = eng, i + 1, eng.queued - saved
            seen |= levels[i]
        return best, best_pages

    def _least(self, role: Role) -> _Engine:
        if role is Role.MAIN:
            if not self._by_active:
                raise Unavailable("no main decode in the fleet")
            return self._by_bit[_lowest(min(self._by_active.items())[1])]
        eng = self._heaps[role].top()
        if eng is None:
            raise Unavailable(f"no {role.value} in the fleet")
        return eng

    # --- bookkeeping ---------------------------------------------------------
    def _begin(
        self,
        route: FleetRoute,
        n_tokens: int,
        hashes: Sequence[bytes],
        main_pages: int,
        prefill_pages: int,
        session: str | None,
    ) -> None:
        self._inflight[route.request_id] = route
        self._routed[route.request_id] = n_tokens
        for eid in {route.prefill, route.main, route.relay} - {None}:
            self._load(
                self._engines[eid],  # type: ignore[index]
                1,
                n_tokens if eid == route.prefill else 0,
            )
        main = self._engines[route.main]
        if route.prefill != route.main:
            self._hold(hashes, main, main_pages, self._engines[route.prefill], prefill_pages)
        else:
            self._hold(hashes, main, main_pages)
        if session is not None:
            self._sessions[session] = route.main

    def _load(self, eng: _Engine, active: int, routed_tokens: int) -> None:
        was = eng.active
        eng.active = max(eng.active + active, 0)
        if eng.active != was and not eng.ejected and Role.MAIN in eng.roles:
            self._unbucket(eng, was)
            self._bucket(eng)
        if routed_tokens:
            eng.routed_tokens = max(eng.routed_tokens + routed_tokens, 0)
            eng.queued = eng.record.load.queued_tokens + eng.routed_tokens
        if not eng.ejected:
            for role in eng.roles:
                if role is Role.MAIN:
                    self._active_total = max(self._active_total + active, 0)
                else:
                    self._heaps[role].push(eng)

    def _hold(
        self,
        hashes: Sequence[bytes],
        a: _Engine,
        a_held: int,
        b: _Engine | None = None,
        b_held: int = 0,
    ) -> None:
        """``a`` (and ``b``) now hold every page of ``hashes``: the first
        ``a_held`` (``b_held``) they held already, refreshed in their LRU
        order; the rest are added (a page held past a gap keeps its place)."""
        holders = self._holders
        get = holders.get
        if b is None:
            holders.update({h: get(h, 0) | a.bit for h in hashes[a_held:]})
        else:
            (lo_eng, lo), (_, hi) = sorted(((a, a_held), (b, b_held)), key=lambda x: x[1])
            both = a.bit | b.bit
            holders.update({h: get(h, 0) | lo_eng.bit for h in hashes[lo:hi]})
            holders.update({h: get(h, 0) | both for h in hashes[hi:]})
        for eng, held in ((a, a_held), (b, b_held)):
            if eng is None:
                continue
            pages = eng.pages
            # held pages are in ``pages`` (a holder's bit is set exactly for its pages)
            deque(map(pages.move_to_end, hashes[:held]), maxlen=0)
            if len(hashes) > held:
                pages.update(dict.fromkeys(hashes[held:]))
                self._evict(eng)

    def _note(self, eng: _Engine, h: bytes) -> None:
        if h in eng.pages:
            eng.pages.move_to_end(h)
            return
        eng.pages[h] = None
        self._holders[h] = self._holders.get(h, 0) | eng.bit
        self._evict(eng)

    def _evict(self, eng: _Engine) -> None:
        pages, limit = eng.pages, self.config.max_pages_per_engine
        while len(pages) > limit:
            old, _ = pages.popitem(last=False)
            self._forget(eng.bit, old)

    def _forget(self, bit: int, h: bytes) -> None:
        rest = self._holders.get(h, 0) & ~bit
        if rest:
            self._holders[h] = rest
        else:
            self._holders.pop(h, None)

    def _add(self, eid: str, record: EngineRecord) -> _Engine:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
        eng = _Engine(eid, record, 1 << slot)
        self._engines[eid] = eng
        self._by_bit[eng.bit] = eng
        self._join_roles(eng)
        return eng

    def _join_roles(self, eng: _Engine) -> None:
        if eng.ejected:
            return
        for role in eng.roles:
            self._members[role][eng.engine_id] = eng
            self._mask[role] |= eng.bit
            if role is not Role.MAIN:
                self._heaps[role].push(eng)
        if Role.MAIN in eng.roles:
            self._active_total += eng.active
            self._bucket(eng)

    def _leave_roles(self, eng: _Engine) -> None:
        if eng.ejected:
            return
        for role in eng.roles:
            if self._members[role].pop(eng.engine_id, None) is not None:
                self._mask[role] &= ~eng.bit
        if Role.MAIN in eng.roles:
            self._active_total = max(self._active_total - eng.active, 0)
            self._unbucket(eng, eng.active)

    def _bucket(self, eng: _Engine) -> None:
        self._by_active[eng.active] = self._by_active.get(eng.active, 0) | eng.bit

    def _unbucket(self, eng: _Engine, active: int) -> None:
        rest = self._by_active.get(active, 0) & ~eng.bit
        if rest:
            self._by_active[active] = rest
        else:
            self._by_active.pop(active, None)

    def _lose(self, eid: str) -> list[Reroute]:
        eng = self._engines.pop(eid, None)
        if eng is None:
            return []
        self._leave_roles(eng)
        for h in eng.pages:
            self._forget(eng.bit, h)
        del self._by_bit[eng.bit]
        heapq.heappush(self._free_slots, eng.bit.bit_length() - 1)
        for s in [s for s, m in self._sessions.items() if m == eid]:
            del self._sessions[s]
        out: list[Reroute] = []
        for rid, r in list(self._inflight.items()):
            if r.relay == eid and r.main != eid and r.prefill != eid:
                # a dead relay: the main decode takes the stream over, as a
                # P-RLD-MD handoff does when the relay stops
                self._inflight[rid] = FleetRoute(
                    rid, r.prefill, None, r.main, r.matched_tokens, r.decision
                )
                out.append(Reroute(rid, "main", r.main))
                continue
            if eid not in (r.prefill, r.main):
                continue
            stage = "prefill" if r.prefill == eid else "main"
            try:
                new = self._least(Role.PREFILL if stage == "prefill" else Role.MAIN)
            except Unavailable:
                continue  # nothing to move it to: the caller fails the request
            prefill, main = (
                (new.engine_id, r.main) if stage == "prefill" else (r.prefill, new.engine_id)
            )
            self._inflight[rid] = FleetRoute(rid, prefill, r.relay, main, 0, r.decision)
            if stage == "prefill":
                self._prefilled.discard(rid)
            self._load(new, 1, self._routed.get(rid, 0) if stage == "prefill" else 0)
            out.append(Reroute(rid, stage, new.engine_id))
        return out


def _least_of(mask: int, buckets: list[tuple[int, int]]) -> int:
    """The bits of ``mask`` in the least loaded bucket (``buckets``: load ->
    bits, least first; every bit of ``mask`` is in one of them)."""
    for _, m in buckets:
        got = mask & m
        if got:
            return got
    return mask  # pragma: no cover (not reached: the buckets cover the members)


def _lowest(mask: int) -> int:
    return mask & -mask


def _depth(levels: list[int], bit: int) -> int:
    """How many leading pages the engine with ``bit`` holds."""
    lo, hi = 0, len(levels)  # levels are nested: binary search for the last one with ``bit``
    while lo < hi:
        mid = (lo + hi) // 2
        if levels[mid] & bit:
            lo = mid + 1
        else:
            hi = mid
    return lo
