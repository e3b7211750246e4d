"""The fleet router core, sans-IO.

Fed by registry view changes (:meth:`FleetRouter.apply`), it chooses per
request a prefill (least queued work, less what its own prefix cache holds),
the pipeline (``kvbridge.router.Router``: P-MD or P-RLD-MD), a relay when the
pipeline has one (least load) and a main decode: the one holding the longest
prefix of the request (the prefixes routed there, and those its load reports
list), among those not above their share of the requests in flight by more
than ``load_factor``; a session keeps its main decode while that holds.
Engines whose lease ends or whose requests fail ``max_failures`` times in a
row are ejected, and taken back when they register again (a new generation).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbridge.cache.hashing import page_hashes
from kvbridge.errors import InvalidArgument, Unavailable
from kvbridge.registry.records import EngineRecord, Role
from kvbridge.registry.view import ViewChange
from kvbridge.router import Decision, Pipeline, Router

__all__ = ["FleetConfig", "FleetRoute", "FleetRouter", "Reroute"]

_EMPTY: frozenset[str] = frozenset()


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


@dataclass
class _Engine:
    record: EngineRecord
    pages: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    active: int = 0
    failures: int = 0
    ejected: bool = False


class FleetRouter:
    def __init__(self, router: Router, config: FleetConfig | None = None) -> None:
        self.router = router
        self.config = config or FleetConfig()
        self._engines: dict[str, _Engine] = {}
        self._holders: dict[bytes, set[str]] = {}  # page hash -> main decodes / prefills holding it
        self._sessions: dict[str, str] = {}
        self._inflight: dict[str, FleetRoute] = {}
        self._eligible: dict[Role, list[str]] = {}  # cleared whenever membership changes

    # --- the view's feed ----------------------------------------------------
    def apply(self, change: ViewChange) -> list[Reroute]:
        """A registry view change; returns the re-routing of requests in
        flight on an engine that left."""
        eid = change.engine_id
        self._eligible.clear()
        if change.record is None:
            return self._lose(eid)
        eng = self._engines.get(eid)
        if eng is None or change.restarted:
            reroutes = self._lose(eid) if eng is not None else []
            eng = self._engines[eid] = _Engine(change.record)
        else:
            reroutes = []
            eng.record = change.record
        for h in change.record.prefixes:
            self._note(eid, eng, h)
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
        matches = self._matches(hashes)
        main = self._pick_main(matches, session)
        prefill = self._pick_prefill(matches, len(tokens))
        matched = matches.get(main, 0) * pt
        pre = self._engines[prefill].record.load.queued_tokens
        decision = self.router.decide(
            request_id, len(tokens), min(matched, len(tokens)), expected_output_tokens,
            compute_tokens=len(tokens) - matches.get(prefill, 0) * pt, queued_tokens=pre,
        )  # fmt: skip
        relay = self._pick(Role.RELAY) if decision.pipeline is Pipeline.P_RLD_MD else None
        route = FleetRoute(request_id, prefill, relay, main, matched, decision)
        self._begin(route, hashes, session)
        return route

    def finish(self, request_id: str, *, failed_on: str | None = None) -> None:
        """The request ended; ``failed_on``: the engine it failed on, if any."""
        route = self._inflight.pop(request_id, None)
        if route is None:
            return
        for eid in {route.prefill, route.main, route.relay} - {None}:
            eng = self._engines.get(eid)  # type: ignore[arg-type]
            if eng is None:
                continue
            eng.active = max(eng.active - 1, 0)
            if eid == failed_on:
                eng.failures += 1
                if eng.failures >= self.config.max_failures:
                    eng.ejected = True
                    self._eligible.clear()
            elif failed_on is None:
                eng.failures = 0

    def eligible(self, role: Role) -> list[str]:
        got = self._eligible.get(role)
        if got is None:
            got = self._eligible[role] = [
                e for e, g in self._engines.items() if not g.ejected and g.record.role.serves(role)
            ]
        return got

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # --- internals -----------------------------------------------------------
    def _matches(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading pages each engine holds (set intersections, page by page)."""
        best: dict[str, int] = {}
        if not hashes:
            return best
        holders = self._holders
        cand = holders.get(hashes[0])
        if not cand:
            return best
        cand = set(cand)
        i = 1
        for h in hashes[1:]:
            nxt = cand & holders.get(h, _EMPTY)
            if len(nxt) != len(cand):
                for eid in cand - nxt:
                    best[eid] = i
            cand = nxt
            if not cand:
                break
            i += 1
        for eid in cand:
            best[eid] = i
        return best

    def _pick_main(self, matches: dict[str, int], session: str | None) -> str:
        mains = self.eligible(Role.MAIN)
        if not mains:
            raise Unavailable("no main decode in the fleet")
        total = sum(self._engines[m].active for m in mains) + 1
        cap = self.config.load_factor * total / len(mains)
        fits = [m for m in mains if self._engines[m].active + 1 <= cap] or mains
        if session is not None:
            kept = self._sessions.get(session)
            if kept in fits:
                return kept
        return max(fits, key=lambda m: (matches.get(m, 0), -self._engines[m].active))

    def _pick_prefill(self, matches: dict[str, int], n_tokens: int) -> str:
        prefills = self.eligible(Role.PREFILL)
        if not prefills:
            raise Unavailable("no prefill in the fleet")
        pt = self.config.page_tokens
        engines = self._engines
        best, best_work = prefills[0], None
        for p in prefills:
            eng = engines[p]
            w = eng.record.load.queued_tokens + eng.active * n_tokens
            if matches:
                w -= matches.get(p, 0) * pt
            if best_work is None or w < best_work:
                best, best_work = p, w
        return best

    def _pick(self, role: Role) -> str:
        cands = self.eligible(role)
        if not cands:
            raise Unavailable(f"no {role.value} in the fleet")

        def load(e: str) -> tuple[int, int]:
            g = self._engines[e]
            return (g.active + g.record.load.active_transfers, g.record.load.queued_tokens)

        return min(cands, key=load)

    def _begin(self, route: FleetRoute, hashes: Sequence[bytes], session: str | None) -> None:
        self._inflight[route.request_id] = route
        for eid in {route.prefill, route.main, route.relay} - {None}:
            self._engines[eid].active += 1  # type: ignore[index]
        for eid in (route.main, route.prefill):
            eng = self._engines[eid]
            pages = eng.pages
            for h in hashes:
                if h not in pages:  # first-in first-out: no reordering per request
                    self._note(eid, eng, h)
        if session is not None:
            self._sessions[session] = route.main

    def _note(self, eid: str, eng: _Engine, h: bytes) -> None:
        if h in eng.pages:
            eng.pages.move_to_end(h)
            return
        eng.pages[h] = None
        self._holders.setdefault(h, set()).add(eid)
        if len(eng.pages) > self.config.max_pages_per_engine:
            old, _ = eng.pages.popitem(last=False)
            self._forget(eid, old)

    def _forget(self, eid: str, h: bytes) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(eid)
            if not holders:
                del self._holders[h]

    def _lose(self, eid: str) -> list[Reroute]:
        eng = self._engines.pop(eid, None)
        if eng is None:
            return []
        for h in eng.pages:
            self._forget(eid, h)
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
                new = self._pick_prefill({}, 0) if stage == "prefill" else self._pick_main({}, None)
            except Unavailable:
                continue  # nothing to move it to: the caller fails the request
            prefill, main = (new, r.main) if stage == "prefill" else (r.prefill, new)
            self._inflight[rid] = FleetRoute(rid, prefill, r.relay, main, 0, r.decision)
            self._engines[new].active += 1
            out.append(Reroute(rid, stage, new))
        return out
