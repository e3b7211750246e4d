"""The fleet router core, sans-IO.

Fed by registry view changes (:meth:`FleetRouter.apply`), it chooses per
request a prefill (least queued work, less what its own prefix cache holds;
a request's prompt is queued work on its prefill from ``route`` until
``prefilled``, or ``finish`` when the caller does not report its prefill),
the pipeline (``kvbridge.router.Router``: P-MD or P-RLD-MD), a relay when the
pipeline has one (least load) and a main decode: the one holding the longest
prefix of the request (the prefixes routed there, and those its load reports
list), among those not above their share of the requests in flight by more
than ``load_factor``; a session keeps its main decode while that holds.
Engines whose lease ends or whose requests fail ``max_failures`` times in a
row are ejected, and taken back when they register again (a new generation).

The state the choices read lives in the compiled core (``kvbridge._core.
FleetCore``, csrc/fleet/): each engine owns a slot, the prefix index maps a
128-bit page hash to the bit set of the engines holding it, each engine's
pages are kept in LRU order, prefills and relays come from lazily checked
heaps. A decision is two calls into it: ``choose`` reads the request's page
hashes (in place, once) and returns the main decode and the prefill with the
pages each holds; ``commit`` applies the loads and the holds for those same
pages. This module keeps the engine ids, records, sessions, requests in
flight, failures, the pipeline decision and the re-routes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge import _core
from kvbridge.cache.hashing import page_hashes
from kvbridge.errors import InvalidArgument, Unavailable
from kvbridge.registry.records import EngineRecord, Role
from kvbridge.registry.view import ViewChange
from kvbridge.router import Decision, Pipeline, Reason, Router

__all__ = ["FleetConfig", "FleetRoute", "FleetRouter", "Reroute"]


@dataclass(frozen=True)
class FleetConfig:
    page_tokens: int = 16
    load_factor: float = 1.5  # no main decode above its share by more than this
    max_failures: int = 3  # consecutive failed requests before an engine is ejected
    max_pages_per_engine: int = 65536  # prefix index entries kept per engine (LRU)

    def __post_init__(self) -> None:
        if (
            self.page_tokens < 1
            or self.load_factor < 1
            or self.max_failures < 1
            or self.max_pages_per_engine < 0
        ):
            raise InvalidArgument(
                "page_tokens >= 1, load_factor >= 1, max_failures >= 1, max_pages_per_engine >= 0"
            )


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


class FleetRouter:
    def __init__(self, router: Router, config: FleetConfig | None = None) -> None:
        self.router = router
        self.config = config or FleetConfig()
        # the state and the choices: engines in slots, the prefix index, the loads
        self._core = _core.FleetCore(self.config.load_factor, self.config.max_pages_per_engine)
        self._slots: dict[str, int] = {}  # engine id -> its slot in the core
        self._ids: list[str | None] = []  # slot -> engine id
        self._records: dict[str, EngineRecord] = {}
        self._failures: dict[str, int] = {}  # consecutive failures, where not 0
        self._ejected: set[str] = set()
        self._sessions: dict[str, str] = {}
        self._inflight: dict[str, FleetRoute] = {}
        self._routed: dict[str, int] = {}  # request -> its prompt tokens
        self._prefilled: set[str] = set()  # requests whose prompt left their prefill's queue

    # --- the view's feed ----------------------------------------------------
    def apply(self, change: ViewChange) -> list[Reroute]:
        """A registry view change; returns the re-routing of requests in
        flight on an engine that left."""
        eid = change.engine_id
        record = change.record
        if record is None:
            return self._lose(eid)
        slot = self._slots.get(eid)
        reroutes: list[Reroute] = []
        if slot is None or change.restarted:
            if slot is not None:
                reroutes = self._lose(eid)
            slot = self._add(eid, record)
        else:
            self._records[eid] = record
            load = record.load
            self._core.update(slot, _roles(record), load.queued_tokens, load.active_transfers)
        if record.prefixes:
            self._core.note(slot, record.prefixes)
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
        pt = self.config.page_tokens
        if hashes is None:
            hashes = page_hashes(tokens, pt)
        kept = -1
        if session is not None:
            kept = self._slots.get(self._sessions.get(session, ""), -1)
        core = self._core
        try:
            main_slot, main_pages, prefill_slot, prefill_pages = core.choose(hashes, kept, pt)
        except ValueError as e:
            raise InvalidArgument(f"page hashes: {e}") from None
        if main_slot < 0:
            raise Unavailable("no main decode in the fleet")
        if prefill_slot < 0:
            raise Unavailable("no prefill in the fleet")
        ids = self._ids
        prefill, main = ids[prefill_slot], ids[main_slot]
        assert prefill is not None and main is not None
        n = len(tokens)
        matched = min(main_pages * pt, n)
        decision = self.router.decide(
            request_id, n, matched, expected_output_tokens,
            compute_tokens=n - min(prefill_pages * pt, n),
            queued_tokens=self._records[prefill].load.queued_tokens,
        )  # fmt: skip
        relay = None
        relay_slot = -1
        if decision.pipeline is Pipeline.P_RLD_MD:
            relay_slot = core.least(_RELAY)
            if relay_slot >= 0:
                relay = ids[relay_slot]
            else:  # no relay in the fleet: the main decode serves it alone
                decision = dataclasses.replace(
                    decision, pipeline=Pipeline.P_MD, reason=Reason.NO_RELAY
                )
        route = _route(request_id, prefill, relay, main, matched, decision)
        self._inflight[request_id] = route
        self._routed[request_id] = n
        # loads, and the pages both now hold (the ones ``choose`` read)
        core.commit(prefill_slot, main_slot, relay_slot, n, main_pages, prefill_pages)
        if session is not None:
            self._sessions[session] = main
        return route

    def prefilled(self, request_id: str) -> None:
        """The request's prefill ended: its prompt tokens leave its prefill's
        queued work (the request stays in flight, on its prefill too, until
        :meth:`finish`). Idempotent; an id not in flight is ignored, as
        :meth:`finish` ignores it. A request re-routed to another prefill
        (``Reroute`` stage ``"prefill"``) is queued there again until this
        is called for it again."""
        route = self._inflight.get(request_id)
        if route is None or request_id in self._prefilled:
            return
        self._prefilled.add(request_id)
        self._core.prefilled(self._slots.get(route.prefill, -1), self._routed.get(request_id, 0))

    def finish(self, request_id: str, *, failed_on: str | None = None) -> None:
        """The request ended; ``failed_on``: the engine it failed on, if any.
        Releases its prompt tokens from its prefill's queued work unless
        :meth:`prefilled` did."""
        route = self._inflight.pop(request_id, None)
        if route is None:
            return
        n = self._routed.pop(request_id, 0)
        if self._prefilled and request_id in self._prefilled:
            self._prefilled.discard(request_id)
            n = 0
        slots = self._slots
        relay = route.relay
        self._core.finish(
            slots.get(route.prefill, -1),
            slots.get(route.main, -1),
            -1 if relay is None else slots.get(relay, -1),
            n,
        )
        if failed_on is not None:
            if failed_on in slots and failed_on in (route.prefill, route.main, relay):
                failures = self._failures[failed_on] = self._failures.get(failed_on, 0) + 1
                if failures >= self.config.max_failures and failed_on not in self._ejected:
                    self._core.eject(slots[failed_on])
                    self._ejected.add(failed_on)
        elif self._failures:
            for eid in (route.prefill, route.main, relay):
                self._failures.pop(eid, None)  # type: ignore[arg-type]

    def eligible(self, role: Role) -> list[str]:
        ids = self._ids
        return [ids[s] for s in self._core.members(_ROLE_INDEX[role])]  # type: ignore[misc]

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # --- membership ------------------------------------------------------------
    def _add(self, eid: str, record: EngineRecord) -> int:
        load = record.load
        slot: int = self._core.add(_roles(record), load.queued_tokens, load.active_transfers)
        ids = self._ids
        if slot >= len(ids):
            ids.extend([None] * (slot + 1 - len(ids)))
        ids[slot] = eid
        self._slots[eid] = slot
        self._records[eid] = record
        return slot

    def _least(self, role: Role) -> str:
        slot = self._core.least(_ROLE_INDEX[role])
        if slot < 0:
            raise Unavailable(f"no {role.value} in the fleet")
        eid = self._ids[slot]
        assert eid is not None
        return eid

    def _lose(self, eid: str) -> list[Reroute]:
        slot = self._slots.pop(eid, None)
        if slot is None:
            return []
        del self._records[eid]
        self._failures.pop(eid, None)
        self._ejected.discard(eid)
        self._ids[slot] = None
        self._core.remove(slot)
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
            prefill, main = (new, r.main) if stage == "prefill" else (r.prefill, new)
            self._inflight[rid] = FleetRoute(rid, prefill, r.relay, main, 0, r.decision)
            if stage == "prefill":  # prefilled again there: queued there until then
                self._prefilled.discard(rid)
            self._core.load(
                self._slots[new], 1, self._routed.get(rid, 0) if stage == "prefill" else 0
            )
            out.append(Reroute(rid, stage, new))
        return out


_ROUTE_FIELDS = tuple(f.name for f in dataclasses.fields(FleetRoute))


def _route(*values: object) -> FleetRoute:
    """``FleetRoute(*values)`` without the frozen dataclass's one
    ``object.__setattr__`` call per field (one route per request)."""
    r = object.__new__(FleetRoute)
    r.__dict__.update(zip(_ROUTE_FIELDS, values, strict=True))
    return r


_ROLE_INDEX = {Role.PREFILL: 0, Role.RELAY: 1, Role.MAIN: 2}
_RELAY = _ROLE_INDEX[Role.RELAY]


def _roles(record: EngineRecord) -> int:
    """The roles an engine serves, as the core's bits (prefill 1, relay 2, main 4)."""
    return sum(1 << i for r, i in _ROLE_INDEX.items() if record.role.serves(r))
