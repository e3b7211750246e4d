"""The PDD orchestration core (sans-IO): one place for every decision of
the pipeline, whatever drives it.

Given a request and the fleet's state it decides

- the pipeline (:class:`kvbridge.router.Router`: P-MD, P-RLD-MD, and P-RLD
  only through the router's anomalous-traffic filter) and the destinations
  of the dual-path send, fed back by the prefill's times and the WAN's
  transfers (:class:`Arrive`, :class:`PrefillDone`, :class:`KVSent`);
- the relay's dynamic token budget, by the relay's live load and the main
  decode's expected readiness (:mod:`kvbridge.pdd.budget`);
- when and how to hand over: one-shot, or catch-up in rounds above a
  threshold, by the relay's load (the relay's and the main decode's
  handoff machines, :class:`~kvbridge.handoff.RelaySide` and
  :class:`~kvbridge.handoff.MainSide`, with
  :class:`~kvbridge.handoff.HandoffPolicy`);
- the client's exactly-once merge of the two token streams
  (:class:`~kvbridge.handoff.StreamMerge`) and the switch gap.

:meth:`PddCore.handle` takes one event (:mod:`kvbridge.pdd.events`) and
returns the commands the driver carries out.  One core may play every role
(the vLLM proxy) or one process may hold the core of its own role (the
reference demo: the prefill routes, the relay and the main decode hand
over, the client merges); the decisions are the same.  With ``record`` the
core keeps the log of ``(event, commands)`` pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidArgument
from ..handoff.main import MainSide, MainState
from ..handoff.messages import Ack, Done, Ready, Source, Tokens
from ..handoff.outputs import HandoffTimeouts, Output, ToClient
from ..handoff.policy import HandoffPolicy
from ..handoff.relay import RelaySide
from ..handoff.stream import StreamMerge
from ..router import Pipeline, Router
from .budget import RelayBudget, RelayLoad, StepClock
from .events import (
    Arrive,
    ClientOpen,
    ClientStream,
    Command,
    Deliver,
    Emit,
    Ended,
    Event,
    Finish,
    KVSent,
    MainExtend,
    MainExtended,
    MainKVReady,
    MainRun,
    MainStart,
    MainToken,
    PeerLost,
    PeerMessage,
    PrefillDone,
    RelayRun,
    RelayStart,
    RelayStats,
    RelayToken,
    Role,
    Route,
    SendHandoff,
    StreamDone,
    Tick,
)

__all__ = ["PddConfig", "PddCore"]

DESTINATIONS = {
    Pipeline.P_MD: ("md",),
    Pipeline.P_RLD_MD: ("md", "rld"),
    Pipeline.P_RLD: ("rld",),
}


@dataclass(frozen=True)
class PddConfig:
    """``handoff``: one-shot / catch-up and the commit rule; ``budget``: the
    relay's token budget; ``timeouts``: every wait of the handoff;
    ``relay_capacity``: relayed requests at which the relay's load is 1
    (``relay_load``: a fixed load instead); ``step_prior_s``: seconds per
    relay step before any is measured; ``allow_p_rld``: False turns the
    anomalous filter's P-RLD into P-RLD-MD; ``gap_timeout``,
    ``idle_timeout``: the client merge's deadlines; ``switch_window``:
    positions on each side of the switch whose pauses count as its gap."""

    handoff: HandoffPolicy = field(default_factory=HandoffPolicy)
    budget: RelayBudget = field(default_factory=RelayBudget)
    timeouts: HandoffTimeouts = field(default_factory=HandoffTimeouts)
    relay_capacity: int = 8
    relay_load: float | None = None
    step_prior_s: float = 0.08
    allow_p_rld: bool = True
    gap_timeout: float = 30.0
    idle_timeout: float = 60.0
    switch_window: int = 3

    def __post_init__(self) -> None:
        if self.relay_capacity < 1 or self.switch_window < 0:
            raise InvalidArgument("relay_capacity must be >= 1 and switch_window >= 0")


@dataclass
class _Req:
    rid: int
    route: Route | None = None
    md_bytes: int = 0  # counted in the WAN's queue until the KV lands
    compute: int = 0  # counted in the prefill's queue until it is done
    queued: bool = False
    eta_at: float | None = None
    relay: RelaySide | None = None
    relay_run: bool = False
    relay_counted: bool = False
    relay_last_t: float | None = None
    main: MainSide | None = None
    main_kv: bool = False  # the KV landed before the main decode learned the request
    extending: int = 0  # tokens of the MainExtend in flight
    main_run: bool = False
    merge: StreamMerge | None = None
    arrivals: list[float] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    first_src: dict[int, Source] = field(default_factory=dict)
    ended: set[Role] = field(default_factory=set)


class PddCore:
    """See the module text.  ``router``: the prefill's router (a core that
    only hands over or merges needs none)."""

    def __init__(
        self, config: PddConfig | None = None, router: Router | None = None, *, record: bool = False
    ) -> None:
        self.config = config or PddConfig()
        self.router = router
        self.load = RelayLoad(self.config.relay_capacity, self.config.relay_load)
        self.step = StepClock(self.config.step_prior_s)
        self.md_inflight = 0  # bytes on their way over the WAN to the main decode
        self.queued_tokens = 0  # prefill work ahead of a new request
        self.queued_requests = 0
        self.record = record
        self.log: list[tuple[Event, list[Command]]] = []
        self._reqs: dict[int, _Req] = {}

    # ---- queries ---------------------------------------------------------------------------
    def relay(self, rid: int) -> RelaySide | None:
        r = self._reqs.get(rid)
        return r.relay if r is not None else None

    def main(self, rid: int) -> MainSide | None:
        r = self._reqs.get(rid)
        return r.main if r is not None else None

    def merge(self, rid: int) -> StreamMerge | None:
        r = self._reqs.get(rid)
        return r.merge if r is not None else None

    def route_of(self, rid: int) -> Route | None:
        r = self._reqs.get(rid)
        return r.route if r is not None else None

    def relay_budget(self, rid: int, now: float) -> int | None:
        r = self._reqs.get(rid)
        return r.relay.budget(now) if r is not None and r.relay is not None else None

    @property
    def active(self) -> int:
        """Requests the core keeps state for."""
        return len(self._reqs)

    def next_deadline(self) -> float | None:
        """The earliest handoff deadline (feed :class:`Tick` then)."""
        ds: list[float] = []
        for r in self._reqs.values():
            for side in (r.relay, r.main):
                if side is not None and not side.done:
                    d = side.next_deadline()
                    if d is not None:
                        ds.append(d)
        return min(ds) if ds else None

    # ---- the one entry point ---------------------------------------------------------------
    def handle(self, ev: Event) -> list[Command]:
        cmds = self._dispatch(ev)
        if self.record:
            self.log.append((ev, list(cmds)))
        return cmds

    def _dispatch(self, ev: Event) -> list[Command]:
        match ev:
            case Arrive():
                return self._arrive(ev)
            case PrefillDone():
                r = self._reqs.get(ev.rid)
                if r is not None and r.queued:
                    r.queued = False
                    self.queued_tokens -= r.compute
                    self.queued_requests -= 1
                if self.router is not None:
                    self.router.prefill.observe(ev.computed_tokens, ev.seconds)
                return []
            case KVSent():
                r = self._reqs.get(ev.rid)
                if ev.dest == "md" and r is not None:
                    self.md_inflight -= r.md_bytes
                    r.md_bytes = 0
                if ev.dest == "md" and ev.ok and ev.seconds > 0 and self.router is not None:
                    self.router.observe_transfer(ev.nbytes, ev.seconds)
                return []
            case RelayStart():
                return self._relay_start(ev)
            case RelayToken():
                return self._relay_token(ev)
            case RelayStats():
                self.step.observe_engine(ev.busy_s, ev.passes)
                return []
            case MainStart():
                return self._main_start(ev)
            case MainKVReady():
                r = self._req(ev.rid)
                if r.main is None:
                    r.main_kv = True
                    return []
                return self._main_out(r, r.main.on_kv_ready(ev.now))
            case MainExtended():
                r = self._req(ev.rid)
                m = self._need_main(r)
                if ev.count != r.extending:
                    raise InvalidArgument(
                        f"request {ev.rid}: extended {ev.count} tokens, {r.extending} were asked"
                    )
                r.extending = 0
                return self._main_out(r, m.on_extended(ev.count, ev.now))
            case MainToken():
                r = self._req(ev.rid)
                return self._main_out(r, self._need_main(r).on_token(ev.token, ev.now))
            case PeerMessage():
                return self._peer(ev)
            case PeerLost():
                r = self._req(ev.rid)
                if ev.role is Role.RELAY and r.relay is not None:
                    return self._relay_out(r, r.relay.peer_gone(ev.now))
                if ev.role is Role.MAIN and r.main is not None:
                    return self._main_out(r, r.main.peer_gone(ev.now))
                return []
            case Tick():
                out: list[Command] = []
                reqs = self._reqs.values() if ev.rid is None else [self._req(ev.rid)]
                for r in list(reqs):
                    relay_ok = ev.role in (None, Role.RELAY)
                    main_ok = ev.role in (None, Role.MAIN)
                    if relay_ok and r.relay is not None and not r.relay.done:
                        self._set_load(r)
                        out += self._relay_out(r, r.relay.poll(ev.now))
                    if main_ok and r.main is not None and not r.main.done:
                        out += self._main_out(r, r.main.poll(ev.now))
                return out
            case ClientOpen():
                r = self._req(ev.rid)
                c = self.config
                r.merge = StreamMerge(
                    ev.rid, gap_timeout=c.gap_timeout, idle_timeout=c.idle_timeout, now=ev.now
                )
                return []
            case ClientStream():
                return self._client(ev)
            case Finish():
                r = self._reqs.get(ev.rid)
                if r is None:
                    return []
                if ev.role is Role.RELAY:
                    self._uncount(r)
                    r.relay = None
                elif ev.role is Role.MAIN:
                    r.main = None
                elif ev.role is Role.CLIENT:
                    r.merge = None
                if ev.role is None or (r.relay is None and r.main is None and r.merge is None):
                    del self._reqs[ev.rid]
                    self._release(r)
                return []
        raise InvalidArgument(f"not a PDD event: {ev!r}")

    # ---- routing ---------------------------------------------------------------------------
    def _arrive(self, ev: Arrive) -> list[Command]:
        if ev.rid in self._reqs:
            raise InvalidArgument(f"request {ev.rid} arrived twice")
        r = self._reqs[ev.rid] = _Req(ev.rid)
        decision = None
        eta_s = 0.0
        if ev.pipeline is not None:
            pipeline, reason = ev.pipeline, "fixed pipeline"
            if self.router is not None:
                self.router.counts[pipeline] += 1
        else:
            if self.router is None:
                raise InvalidArgument("this core has no router: give the pipeline")
            decision = self.router.decide(
                str(ev.rid),
                ev.input_tokens,
                ev.matched_tokens,
                ev.max_new_tokens,
                queued_bytes=self.md_inflight,
                compute_tokens=ev.compute_tokens,
                queued_tokens=self.queued_tokens,
                queued_requests=self.queued_requests,
            )
            pipeline, reason, eta_s = decision.pipeline, decision.reason.value, decision.wan_s
            if pipeline is Pipeline.P_RLD and not self.config.allow_p_rld:
                pipeline = Pipeline.P_RLD_MD
        dest = DESTINATIONS[pipeline]
        if "md" in dest and self.router is not None:
            r.md_bytes = self.router.layout.wire_nbytes(ev.input_tokens - ev.matched_tokens)
            self.md_inflight += r.md_bytes
        if ev.compute_tokens is not None:
            r.compute, r.queued = ev.compute_tokens, True
            self.queued_tokens += r.compute
            self.queued_requests += 1
        r.route = Route(
            ev.rid,
            pipeline,
            reason,
            dest,
            pipeline is Pipeline.P_RLD_MD,
            eta_s,
            cancel_main=pipeline is Pipeline.P_RLD,
            decision=decision,
        )
        return [r.route]

    # ---- the relay decode ------------------------------------------------------------------
    def _relay_start(self, ev: RelayStart) -> list[Command]:
        r = self._req(ev.rid)
        if r.relay is not None:
            raise InvalidArgument(f"request {ev.rid}: the relay started twice")
        eta_s = ev.eta_s if ev.eta_s is not None else (r.route.eta_s if r.route else None)
        r.eta_at = None if eta_s is None else ev.now + eta_s
        budget = self.config.budget
        params = ev.params

        def tokens(produced: int, now: float) -> int:
            return budget.tokens(
                load=self.load.value,
                produced=produced,
                now=now,
                eta=r.eta_at,
                step_s=self.step.value,
                max_new_tokens=params.max_new_tokens,
            )

        side = r.relay = RelaySide(
            ev.rid, params, self.config.handoff, self.config.timeouts, budget=tokens
        )
        if r.eta_at is not None:
            side.set_eta(r.eta_at)
        self.load.active += 1
        r.relay_counted = True
        self._set_load(r)
        r.relay_last_t = ev.now
        return self._relay_out(r, side.start(ev.first_token, ev.now))

    def _relay_token(self, ev: RelayToken) -> list[Command]:
        r = self._req(ev.rid)
        side = r.relay
        if side is None:
            raise InvalidArgument(f"request {ev.rid}: a relay token before the relay started")
        if r.relay_last_t is not None:
            self.step.observe_gap(ev.now - r.relay_last_t)
        r.relay_last_t = ev.now
        self._set_load(r)
        return self._relay_out(r, side.on_token(ev.token, ev.now))

    def _set_load(self, r: _Req) -> None:
        if r.relay is not None:
            r.relay.set_load(self.load.value)

    def _relay_out(self, r: _Req, outs: list[Output]) -> list[Command]:
        cmds: list[Command] = []
        for o in outs:
            if isinstance(o, ToClient):
                cmds.append(Emit(r.rid, o.message))
            else:
                cmds.append(SendHandoff(r.rid, Role.MAIN, o.message))
        side = r.relay
        assert side is not None
        if side.want_decode != r.relay_run:
            r.relay_run = side.want_decode
            cmds.append(RelayRun(r.rid, r.relay_run))
        if side.done and Role.RELAY not in r.ended:
            r.ended.add(Role.RELAY)
            self._uncount(r)
            cmds.append(Ended(r.rid, Role.RELAY, side.state.name))
        return cmds

    def _uncount(self, r: _Req) -> None:
        if r.relay_counted:
            r.relay_counted = False
            self.load.active -= 1

    # ---- the main decode -------------------------------------------------------------------
    def _main_start(self, ev: MainStart) -> list[Command]:
        r = self._req(ev.rid)
        if r.main is not None:
            raise InvalidArgument(f"request {ev.rid}: the main decode started twice")
        r.main = MainSide(
            ev.rid,
            ev.params,
            ev.prompt_len,
            ev.first_token,
            self.config.timeouts,
            relay=ev.relayed,
        )
        if r.main_kv:
            return self._main_out(r, r.main.on_kv_ready(ev.now))
        return []

    def _main_out(self, r: _Req, outs: list[Output]) -> list[Command]:
        cmds: list[Command] = []
        for o in outs:
            if isinstance(o, ToClient):
                cmds.append(Emit(r.rid, o.message))
            else:
                cmds.append(SendHandoff(r.rid, Role.RELAY, o.message))
        m = r.main
        assert m is not None
        pending = m.to_extend
        if pending and not r.extending and not m.done:
            r.extending = len(pending)
            switch = m.state is MainState.EMITTING or (
                m.commit_end is not None and m.fed + len(pending) >= m.commit_end
            )
            cmds.append(MainExtend(r.rid, m.fed, tuple(pending), switch))
        if m.want_token != r.main_run:
            r.main_run = m.want_token
            cmds.append(MainRun(r.rid, r.main_run))
        if m.done and Role.MAIN not in r.ended:
            r.ended.add(Role.MAIN)
            if r.main_run:
                r.main_run = False
                cmds.append(MainRun(r.rid, False))
            cmds.append(Ended(r.rid, Role.MAIN, m.state.name))
        return cmds

    def _need_main(self, r: _Req) -> MainSide:
        if r.main is None:
            raise InvalidArgument(f"request {r.rid}: the main decode has not started")
        return r.main

    # ---- handoff messages ------------------------------------------------------------------
    def _peer(self, ev: PeerMessage) -> list[Command]:
        r = self._req(ev.rid)
        msg = ev.message
        if isinstance(msg, (Ready, Ack)):
            if r.relay is None:
                return []  # not started here: the main decode resends READY
            self._set_load(r)
            return self._relay_out(r, r.relay.on_message(msg, ev.now))
        if isinstance(msg, (Tokens, Done)):
            if r.main is None:
                return []
            return self._main_out(r, r.main.on_message(msg, ev.now))
        raise InvalidArgument(f"not a decode-to-decode message: {msg!r}")

    # ---- the client ------------------------------------------------------------------------
    def _client(self, ev: ClientStream) -> list[Command]:
        msg = ev.message
        r = self._req(msg.request_id)
        if r.merge is None:
            raise InvalidArgument(f"request {msg.request_id}: the client did not open it")
        m = r.merge
        for i in range(len(msg.tokens)):
            pos = msg.start + i
            if pos >= len(m.tokens):
                r.first_src.setdefault(pos, msg.source)
        start = len(m.tokens)
        new = m.push(msg, ev.now)
        cmds: list[Command] = []
        if new:
            srcs = [r.first_src.pop(start + i, msg.source) for i in range(len(new))]
            r.arrivals += [ev.now] * len(new)
            r.sources += srcs
            k = 0
            while k < len(new):  # one Deliver per run of one source
                j = k
                while j < len(new) and srcs[j] is srcs[k]:
                    j += 1
                cmds.append(Deliver(r.rid, start + k, tuple(new[k:j]), srcs[k]))
                k = j
        if m.done and not any(isinstance(c, StreamDone) for c in cmds):
            at, gap = self._switch(r)
            cmds.append(StreamDone(r.rid, tuple(m.tokens), m.duplicates, m.conflicts, at, gap))
        return cmds

    def _switch(self, r: _Req) -> tuple[int | None, float | None]:
        s = r.sources
        at = next(
            (i for i in range(1, len(s)) if s[i] is Source.MAIN and s[i - 1] is Source.RELAY),
            None,
        )
        if at is None:
            return None, None
        w = self.config.switch_window
        lo, hi = max(1, at - w), min(len(s) - 1, at + w)
        return at, max(r.arrivals[j] - r.arrivals[j - 1] for j in range(lo, hi + 1))

    # ---- internals -------------------------------------------------------------------------
    def _req(self, rid: int) -> _Req:
        r = self._reqs.get(rid)
        if r is None:
            r = self._reqs[rid] = _Req(rid)
        return r

    def _release(self, r: _Req) -> None:
        self._uncount(r)
        if r.md_bytes:
            self.md_inflight -= r.md_bytes
            r.md_bytes = 0
        if r.queued:
            r.queued = False
            self.queued_tokens -= r.compute
            self.queued_requests -= 1
