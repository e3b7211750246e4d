"""The PDD core, directly: event sequences in, commands out.  The route and
the dual-path destinations, the WAN's and the prefill's queues, the relay's
dynamic budget, one-shot and catch-up handoff, and the client's
exactly-once merge (hypothesis: random timings, losses, duplicates and
reorders, both handoff modes)."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import InvalidArgument
from kvbridge.handoff import HandoffPolicy, HandoffTimeouts, Mode, SamplingParams, Source
from kvbridge.handoff.messages import Ready, StreamTokens, Tokens, decode, encode
from kvbridge.layout import DType, KVLayout
from kvbridge.pdd import (
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
    PddConfig,
    PddCore,
    PeerMessage,
    PrefillDone,
    RelayBudget,
    RelayRun,
    RelayStart,
    RelayToken,
    Role,
    Route,
    SendHandoff,
    StepClock,
    StreamDone,
    Tick,
)
from kvbridge.router import BandwidthEstimator, Pipeline, Router, RouterConfig

LAYOUT = KVLayout(2, 2, 64, dtype=DType.BF16, page_tokens=16)  # 1 KiB per token


def token_at(i: int) -> int:
    return (i * 2654435761 + 12345) % 50000


def router(**kw: object) -> Router:
    cfg = RouterConfig(ttft_target_s=1.0, base_latency_s=0.0, **kw)  # type: ignore[arg-type]
    return Router(LAYOUT, cfg, BandwidthEstimator(prior_bps=1e6, prior_cv=0.0))


# ---- the budget (moved here from the handoff policy) -------------------------------------------
def test_budget_shrinks_with_load() -> None:
    b = RelayBudget(busy_load=0.5, token_budget=200, min_budget=20)
    assert b.cap(0.0) == b.cap(0.5) == 200
    assert b.cap(1.0) == 20
    values = [b.cap(x / 20) for x in range(21)]
    assert values == sorted(values, reverse=True)


def test_the_dynamic_budget_covers_the_expected_wait_and_no_more() -> None:
    b = RelayBudget(token_budget=64, min_budget=8, eta_headroom=0.5, eta_min_extra=4)
    assert b.dynamic(0.0, None) == 64  # unknown wait: the load's cap
    assert b.dynamic(0.0, 10) == 19  # 10 * 1.5 + 4
    assert b.dynamic(0.0, 0) == 4
    assert b.dynamic(0.0, 1000) == 64  # never above the load's cap
    assert b.dynamic(1.0, 1000) == 8  # which shrinks with the load
    # leave_last: never the last token
    kw = dict(load=0.0, produced=0, now=0.0, eta=None, step_s=None)
    assert b.tokens(max_new_tokens=10, **kw) == 9  # type: ignore[arg-type]
    assert RelayBudget(leave_last=False).tokens(max_new_tokens=10, **kw) == 512  # type: ignore[arg-type]


def test_bad_budget() -> None:
    for kw in ({"min_budget": 0}, {"token_budget": 8, "min_budget": 9}, {"busy_load": 2.0}):
        with pytest.raises(InvalidArgument):
            RelayBudget(**kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        PddConfig(relay_capacity=0)


def test_step_clock_prefers_the_engine_counters() -> None:
    c = StepClock(0.1, alpha=0.5, min_passes=4)
    c.observe_gap(0.3)
    assert c.value == pytest.approx(0.2)
    c.observe_engine(0.2, 2)  # too few passes: ignored
    assert c.value == pytest.approx(0.2)
    c.observe_engine(0.4, 8)  # 0.05 s a pass
    assert c.value == pytest.approx(0.125)
    c.observe_gap(1.0)  # the engine's counters win from now on
    assert c.value == pytest.approx(0.125)


def test_the_core_caps_the_relay_at_the_expected_wait() -> None:
    """The main decode is expected ready 0.2 s after the relay's start, at
    50 ms a relay step: the relay makes the wait's tokens with headroom, then
    stops (RelayRun False) and waits for READY until capped_wait past that."""
    b = RelayBudget(token_budget=64, min_budget=8, eta_headroom=0.5, eta_min_extra=4)
    core = PddCore(PddConfig(budget=b, step_prior_s=0.05), record=True)
    p = SamplingParams(0.0, max_new_tokens=100)
    cmds = core.handle(RelayStart(1, 7, p, 10.0, eta_s=0.2))
    assert cmds == [
        Emit(1, StreamTokens(1, 0, (7,), Source.RELAY)),
        RelayRun(1, True),
    ]
    assert core.load.active == 1 and core.load.value == 1 / 8
    t, out = 10.0, []
    while not any(isinstance(c, RelayRun) for c in out):
        t += 0.05
        out = core.handle(RelayToken(1, 7, t))
    side = core.relay(1)
    assert side is not None and len(side.tokens) == b.dynamic(1 / 8, 5) == 12
    assert out[-1] == RelayRun(1, False)
    deadline = core.next_deadline()
    assert deadline is not None and deadline >= 10.2 + side.timeouts.capped_wait - 1e-9
    assert core.handle(Tick(deadline - 0.01)) == []
    out = core.handle(Tick(deadline))  # the main decode counts as failed: the relay keeps it
    assert RelayRun(1, True) in out and side.kept
    assert core.log[0][0] == RelayStart(1, 7, p, 10.0, eta_s=0.2)


def test_load_shrinks_the_budget_and_switches_to_one_shot() -> None:
    core = PddCore(
        PddConfig(
            handoff=HandoffPolicy(busy_load=0.5),
            budget=RelayBudget(token_budget=100, min_budget=10, busy_load=0.5),
            relay_capacity=2,
        )
    )
    p = SamplingParams(0.0, max_new_tokens=500)
    core.handle(RelayStart(1, 1, p, 0.0))
    assert core.relay_budget(1, 0.0) == 100  # load 0.5: not above busy_load
    core.handle(RelayStart(2, 1, p, 0.0))
    assert core.load.value == 1.0 and core.relay_budget(2, 0.0) == 10
    core.handle(PeerMessage(2, Ready(2, 10, 1), 0.1))
    side = core.relay(2)
    assert side is not None and side.mode is Mode.ONE_SHOT
    core.handle(Finish(1, 0.2))
    core.handle(Finish(2, 0.2, Role.RELAY))
    assert core.load.active == 0


# ---- routing ----------------------------------------------------------------------------------
def test_route_and_dual_path_destinations() -> None:
    core = PddCore(router=router(), record=True)
    # 100 tokens missing = 100 KiB at 1 MB/s: 0.1 s, within the 1 s target -> P-MD
    (r1,) = core.handle(Arrive(1, 1000, 900, 32, 0.0))
    assert isinstance(r1, Route) and r1.pipeline is Pipeline.P_MD and r1.destinations == ("md",)
    assert not r1.relayed and r1.decision is not None
    assert core.md_inflight == LAYOUT.wire_nbytes(100)
    # 1000 missing tokens behind the first: 1.1 s -> P-RLD-MD, both destinations
    (r2,) = core.handle(Arrive(2, 1000, 0, 32, 0.0))
    assert isinstance(r2, Route) and r2.pipeline is Pipeline.P_RLD_MD
    assert r2.destinations == ("md", "rld") and r2.relayed
    assert r2.decision is not None and r2.decision.queued_bytes == LAYOUT.wire_nbytes(100)
    assert r2.eta_s == pytest.approx(r2.decision.wan_s)
    # the first transfer landed: off the queue, and the estimator learned its rate
    core.handle(KVSent(1, "md", 1 << 20, 0.5, 0.6))
    assert core.md_inflight == LAYOUT.wire_nbytes(1000)
    assert core.router is not None and core.router.bandwidth.samples == 1
    core.handle(Finish(2, 0.7))
    assert core.md_inflight == 0 and core.active == 1


def test_fixed_pipelines_and_the_anomalous_filter() -> None:
    cfg = dict(
        anomalous_filter=True,
        anomalous_min_input_tokens=500,
        anomalous_max_output_tokens=10,
        anomalous_max_share=1.0,
    )
    core = PddCore(router=router(**cfg))
    (r,) = core.handle(Arrive(1, 5000, 0, 4, 0.0))
    assert isinstance(r, Route) and r.pipeline is Pipeline.P_RLD
    assert r.destinations == ("rld",) and r.cancel_main and not r.relayed
    assert core.md_inflight == 0
    strict = PddCore(PddConfig(allow_p_rld=False), router=router(**cfg))
    (r,) = strict.handle(Arrive(1, 5000, 0, 4, 0.0))
    assert isinstance(r, Route) and r.pipeline is Pipeline.P_RLD_MD
    (r,) = core.handle(Arrive(2, 5000, 0, 400, 0.0, pipeline=Pipeline.P_MD))
    assert isinstance(r, Route) and r.pipeline is Pipeline.P_MD and r.reason == "fixed pipeline"
    with pytest.raises(InvalidArgument):
        core.handle(Arrive(2, 10, 0, 4, 0.0))  # twice
    with pytest.raises(InvalidArgument):
        PddCore().handle(Arrive(3, 10, 0, 4, 0.0))  # no router, no pipeline


def test_prefill_queue_enters_the_next_estimate() -> None:
    core = PddCore(router=router())
    core.handle(Arrive(1, 1000, 0, 32, 0.0, compute_tokens=800))
    assert (core.queued_tokens, core.queued_requests) == (800, 1)
    (r,) = core.handle(Arrive(2, 100, 90, 32, 0.0, compute_tokens=10))
    assert isinstance(r, Route) and r.decision is not None
    assert r.decision.prefill_s == pytest.approx(core.router.prefill.estimate(10, 800, 1))  # type: ignore[union-attr]
    core.handle(PrefillDone(1, 800, 1.6, 1.0))
    assert (core.queued_tokens, core.queued_requests) == (10, 1)
    assert core.router is not None and core.router.prefill.samples == 1


# ---- one request through every role, in one core ----------------------------------------------
@dataclass
class Loop:
    """Carries out commands at once: handoff messages loop back, stream
    tokens go to the client, every extend and decode happens at once."""

    core: PddCore
    now: float = 0.0
    log: list[Command] = field(default_factory=list)

    def run(self, ev: Event) -> list[Command]:
        self.now = getattr(ev, "now", self.now)
        todo: list[Event] = [ev]
        out: list[Command] = []
        while todo:
            cmds = self.core.handle(todo.pop(0))
            out += cmds
            for c in cmds:
                if isinstance(c, SendHandoff):
                    todo.append(PeerMessage(c.rid, c.message, self.now))
                elif isinstance(c, Emit):
                    todo.append(ClientStream(c.message, self.now))
                elif isinstance(c, MainExtend):
                    todo.append(MainExtended(c.rid, len(c.tokens), self.now))
        self.log += out
        return out


def test_one_shot_handoff_in_one_core() -> None:
    core = PddCore(PddConfig(handoff=HandoffPolicy(force=Mode.ONE_SHOT)), router=router())
    lp = Loop(core)
    p = SamplingParams(0.0, max_new_tokens=10)
    lp.run(Arrive(1, 1000, 0, 10, 0.0, pipeline=Pipeline.P_RLD_MD))
    lp.run(ClientOpen(1, 0.0))
    lp.run(MainStart(1, 1000, token_at(0), p, True, 0.0))
    lp.run(RelayStart(1, token_at(0), p, 0.0))
    for i in range(1, 4):
        lp.run(RelayToken(1, token_at(i), 0.1 * i))
    out = lp.run(MainKVReady(1, 0.5))
    # READY (the main decode holds token 0) -> one TOKENS with the commit ->
    # the first token's step, then one extend of the 3 relay tokens that switches
    sends = [c.message for c in out if isinstance(c, SendHandoff)]
    assert isinstance(sends[0], Ready) and isinstance(sends[1], Tokens) and sends[1].commit
    assert sends[1].start == 1 and sends[1].tokens == tuple(token_at(i) for i in range(1, 4))
    ext = [c for c in out if isinstance(c, MainExtend)]
    assert ext == [
        MainExtend(1, 0, (token_at(0),), False),
        MainExtend(1, 1, tuple(token_at(i) for i in range(1, 4)), True),
    ]
    assert RelayRun(1, False) in out and MainRun(1, True) in out
    assert Ended(1, Role.RELAY, "SWITCHED") in out
    done: list[Command] = []
    for i in range(4, 10):
        done = lp.run(MainToken(1, token_at(i), 0.5 + 0.1 * i))
    fin = [c for c in done if isinstance(c, StreamDone)]
    assert len(fin) == 1 and fin[0].tokens == tuple(token_at(i) for i in range(10))
    assert fin[0].switch_at == 4 and fin[0].duplicates == 0
    assert fin[0].switch_gap_s == pytest.approx(0.5 + 0.4 - 0.3)
    delivered = [c for c in lp.log if isinstance(c, Deliver)]
    assert [d.source for d in delivered].count(Source.RELAY) == 4
    assert Ended(1, Role.MAIN, "FINISHED") in done and MainRun(1, False) in done


def test_catch_up_rounds_then_the_commit() -> None:
    core = PddCore(PddConfig(handoff=HandoffPolicy(threshold=2, force=Mode.CATCH_UP)))
    p = SamplingParams(0.0, max_new_tokens=40)
    lp = Loop(core)
    lp.run(ClientOpen(1, 0.0))
    lp.run(MainStart(1, 100, token_at(0), p, True, 0.0))
    lp.run(RelayStart(1, token_at(0), p, 0.0))
    for i in range(1, 10):
        lp.run(RelayToken(1, token_at(i), 0.01 * i))
    out = lp.run(MainKVReady(1, 0.2))
    # a round hands tokens 1..9 (not the commit); the extend and the ACK came
    # back at once, so the gap is 0: the next message is the commit, and the
    # relay stops at 10
    tok = [c.message for c in out if isinstance(c, SendHandoff) and isinstance(c.message, Tokens)]
    assert [(t.start, len(t.tokens), t.commit) for t in tok] == [(1, 9, False), (10, 0, True)]
    side = core.relay(1)
    assert side is not None and side.rounds == 1 and side.commit_at == 10
    assert RelayRun(1, False) in out and MainRun(1, True) in out
    exts = [c for c in lp.log if isinstance(c, MainExtend)]
    assert [(e.start, len(e.tokens), e.switch) for e in exts] == [(0, 1, False), (1, 9, False)]
    for i in range(10, 40):
        lp.run(MainToken(1, token_at(i), 0.3 + 0.01 * i))
    merge = core.merge(1)
    assert merge is not None and merge.tokens == [token_at(i) for i in range(40)]


def test_main_extended_must_match_the_extend() -> None:
    core = PddCore()
    p = SamplingParams(0.0, max_new_tokens=5)
    core.handle(MainStart(1, 10, 3, p, False, 0.0))
    out = core.handle(MainKVReady(1, 0.0))
    assert MainExtend(1, 0, (3,), True) in out  # P-MD: the first token's step, then decode
    with pytest.raises(InvalidArgument):
        core.handle(MainExtended(1, 2, 0.1))


# ---- exactly once, across both modes, under random timing (hypothesis) ------------------------
@dataclass
class Net:
    """A discrete-event run of one request: the relay and the main decode in
    two cores, a lossy, duplicating, reordering link between them and to the
    client, every step timed by the draw."""

    rng: random.Random
    n: int
    mode: Mode
    threshold: int
    kv_at: float
    relay_step: float
    main_step: float
    extend_token: float
    delay: float
    jitter: float
    loss: float
    dup: float
    budget: int

    def run(self) -> tuple[list[int], StreamDone | None, PddCore]:
        cfg = PddConfig(
            handoff=HandoffPolicy(threshold=self.threshold, max_rounds=6, force=self.mode),
            budget=RelayBudget(token_budget=self.budget, min_budget=1),
            timeouts=HandoffTimeouts(
                ack_timeout=0.2, max_retries=3, capped_wait=50.0, relay_timeout=1.0
            ),
        )
        cores = {"relay": PddCore(cfg), "main": PddCore(cfg), "client": PddCore(cfg)}
        p = SamplingParams(0.0, max_new_tokens=self.n)
        q: list[tuple[float, int, Callable[[], None]]] = []
        seq = itertools.count()
        state = {"now": 0.0}
        done: list[StreamDone] = []

        def at(t: float, fn: Callable[[], None]) -> None:
            heapq.heappush(q, (t, next(seq), fn))

        def link(fn: Callable[[], None], reliable: bool = False) -> None:
            if not reliable and self.rng.random() < self.loss:
                return
            for _ in range(2 if self.rng.random() < self.dup else 1):
                at(state["now"] + self.delay + abs(self.rng.gauss(0, self.jitter)), fn)

        def carry(who: str, cmds: list[Command]) -> None:
            for c in cmds:
                if isinstance(c, Emit):
                    data = encode(c.message)

                    def to_client(d: bytes = data) -> None:
                        m = decode(d)
                        assert isinstance(m, StreamTokens)
                        for x in cores["client"].handle(ClientStream(m, state["now"])):
                            if isinstance(x, StreamDone):
                                done.append(x)

                    link(to_client, reliable=True)  # the client's stream is TCP
                elif isinstance(c, SendHandoff):
                    data = encode(c.message)
                    other = "main" if who == "relay" else "relay"

                    def to_peer(d: bytes = data, w: str = other) -> None:
                        m = decode(d)
                        assert not isinstance(m, StreamTokens)
                        carry(w, cores[w].handle(PeerMessage(1, m, state["now"])))  # type: ignore[arg-type]

                    link(to_peer)
                elif isinstance(c, RelayRun) and c.run:
                    at(state["now"] + self.relay_step, relay_step)
                elif isinstance(c, MainExtend):
                    t = self.main_step + self.extend_token * len(c.tokens)
                    k = len(c.tokens)
                    at(state["now"] + t, lambda k=k: main_extended(k))
                elif isinstance(c, MainRun) and c.run:
                    at(state["now"] + self.main_step, main_step)

        def relay_step() -> None:
            side = cores["relay"].relay(1)
            if side is None or not side.want_decode:
                return
            carry(
                "relay",
                cores["relay"].handle(RelayToken(1, token_at(side.next_index), state["now"])),
            )
            if side.want_decode:
                at(state["now"] + self.relay_step, relay_step)

        def main_extended(k: int) -> None:
            carry("main", cores["main"].handle(MainExtended(1, k, state["now"])))

        def main_step() -> None:
            side = cores["main"].main(1)
            if side is None or not side.want_token:
                return
            carry(
                "main", cores["main"].handle(MainToken(1, token_at(side.next_index), state["now"]))
            )
            if side.want_token:
                at(state["now"] + self.main_step, main_step)

        def tick() -> None:
            for who in ("relay", "main"):
                carry(who, cores[who].handle(Tick(state["now"])))
            if not done:
                at(state["now"] + 0.05, tick)

        cores["client"].handle(ClientOpen(1, 0.0))
        carry("main", cores["main"].handle(MainStart(1, 50, token_at(0), p, True, 0.0)))
        carry("relay", cores["relay"].handle(RelayStart(1, token_at(0), p, 0.0)))
        at(self.kv_at, lambda: carry("main", cores["main"].handle(MainKVReady(1, state["now"]))))
        at(0.05, tick)
        while q and not done and state["now"] < 200:
            t, _, fn = heapq.heappop(q)
            state["now"] = t
            fn()
        merge = cores["client"].merge(1)
        assert merge is not None
        return merge.tokens, (done[0] if done else None), cores["relay"]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 120),
    mode=st.sampled_from([Mode.ONE_SHOT, Mode.CATCH_UP]),
    threshold=st.sampled_from([0, 2, 8, 64]),
    kv_at=st.floats(0.0, 2.0),
    loss=st.sampled_from([0.0, 0.0, 0.1, 0.3]),
    dup=st.sampled_from([0.0, 0.2]),
    budget=st.sampled_from([3, 20, 512]),
)
def test_every_token_reaches_the_client_once_in_order(
    seed: int,
    n: int,
    mode: Mode,
    threshold: int,
    kv_at: float,
    loss: float,
    dup: float,
    budget: int,
) -> None:
    rng = random.Random(seed)
    net = Net(
        rng,
        n,
        mode,
        threshold,
        kv_at,
        relay_step=rng.uniform(0.005, 0.03),
        main_step=rng.uniform(0.005, 0.03),
        extend_token=rng.uniform(0.0, 0.003),
        delay=rng.uniform(0.001, 0.05),
        jitter=rng.uniform(0.0, 0.02),
        loss=loss,
        dup=dup,
        budget=budget,
    )
    tokens, done, _ = net.run()
    assert done is not None, "the stream did not complete"
    assert tokens == [token_at(i) for i in range(n)] == list(done.tokens)
    assert done.conflicts == 0
    if done.switch_at is not None:
        assert 0 < done.switch_at < n and done.switch_gap_s is not None
