"""The relay and main state machines under a discrete-event simulation with a
virtual clock: exactly-once delivery, the atomic switch, catch-up
convergence, and the failure cases, over many seeded random cases.

Tokens are a fixed function of their index (what counter-based sampling
gives), so the expected stream is known; engine steps and links take
virtual time; messages are encoded and decoded on every hop.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kvbridge.handoff import (
    HandoffPolicy,
    HandoffTimeouts,
    MainSide,
    MainState,
    Mode,
    RelaySide,
    RelayState,
    SamplingParams,
    StreamMerge,
    ToClient,
    ToPeer,
    catch_up_rounds,
    decode,
    encode,
)
from kvbridge.handoff.messages import StreamTokens
from kvbridge.pdd import RelayBudget


def token_at(i: int) -> int:
    return (i * 2654435761 + 12345) % 50000


@dataclass
class Link:
    delay: float = 0.01
    jitter: float = 0.0
    loss: float = 0.0
    dup: float = 0.0


@dataclass
class Sim:
    n: int = 200  # max_new_tokens
    policy: HandoffPolicy = field(default_factory=HandoffPolicy)
    budget: RelayBudget = field(default_factory=RelayBudget)
    timeouts: HandoffTimeouts = field(default_factory=HandoffTimeouts)
    relay_step: float = 0.02
    main_step: float = 0.02
    extend_base: float = 0.01
    extend_token: float = 0.001
    kv_at: float = 1.0  # the prompt KV lands on the main decode
    link: Link = field(default_factory=Link)
    client_delay: float = 0.005
    relay_dies_at: float | None = None
    main_dies_at: float | None = None
    main_present: bool = True
    seed: int = 0

    def run(self) -> SimResult:
        rng = random.Random(self.seed)
        params = SamplingParams(max_new_tokens=self.n)
        budget = self.budget

        def cap(produced: int, now: float) -> int:
            return budget.tokens(
                load=0.0,
                produced=produced,
                now=now,
                eta=None,
                step_s=None,
                max_new_tokens=params.max_new_tokens,
            )

        relay = RelaySide(1, params, self.policy, self.timeouts, budget=cap)
        main = MainSide(1, params, 100, token_at(0), self.timeouts)
        merge = StreamMerge(1)
        emitted: Counter[int] = Counter()
        sources: dict[int, set[str]] = {}
        events: list[tuple[float, int, Callable[[], None]]] = []
        seq = itertools.count()
        now = 0.0
        busy = {"relay": False, "main": False}
        res = SimResult()

        def at(t: float, fn: Callable[[], None]) -> None:
            heapq.heappush(events, (t, next(seq), fn))

        def alive(who: str) -> bool:
            dies = self.relay_dies_at if who == "relay" else self.main_dies_at
            present = self.main_present if who == "main" else True
            return present and (dies is None or now < dies)

        def carry(who: str, outs: list[ToPeer | ToClient]) -> None:
            for o in outs:
                data = encode(o.message)
                if isinstance(o, ToClient):
                    for i in range(o.message.start, o.message.end):
                        emitted[i] += 1
                        sources.setdefault(i, set()).add(who)
                    at(now + self.client_delay, lambda d=data: deliver_client(d))
                    continue
                other = "main" if who == "relay" else "relay"
                if rng.random() < self.link.loss:
                    continue
                for _ in range(2 if rng.random() < self.link.dup else 1):
                    t = now + self.link.delay + abs(rng.gauss(0, self.link.jitter))
                    at(t, lambda d=data, w=other: deliver_peer(w, d))

        def deliver_client(data: bytes) -> None:
            msg = decode(data)
            assert isinstance(msg, StreamTokens)
            merge.push(msg, now)

        def deliver_peer(who: str, data: bytes) -> None:
            if not alive(who):
                return
            side = relay if who == "relay" else main
            carry(who, side.on_message(decode(data), now))

        def relay_step_done() -> None:
            busy["relay"] = False
            if alive("relay") and relay.want_decode:
                carry("relay", relay.on_token(token_at(relay.next_index), now))

        def main_extend_done(k: int) -> None:
            busy["main"] = False
            if alive("main"):
                res.extends.append(k)
                carry("main", main.on_extended(k, now))

        def kv_lands() -> None:
            if alive("main"):
                carry("main", main.on_kv_ready(now))

        def schedule() -> None:
            if alive("relay"):
                carry("relay", relay.poll(now))
                if relay.want_decode and not busy["relay"]:
                    busy["relay"] = True
                    at(now + self.relay_step, relay_step_done)
                d = relay.next_deadline()
                if d is not None:
                    at(max(d, now), lambda: None)
            if alive("main"):
                carry("main", main.poll(now))
                while main.want_token:
                    carry("main", main.on_token(token_at(main.next_index), now))
                pending = main.to_extend
                if pending and not busy["main"]:
                    busy["main"] = True
                    k = len(pending)
                    cost = self.main_step if k == 1 else self.extend_base + k * self.extend_token
                    at(now + cost, lambda k=k: main_extend_done(k))
                d = main.next_deadline()
                if d is not None:
                    at(max(d, now), lambda: None)

        carry("relay", relay.start(token_at(0), 0.0))
        at(self.kv_at, kv_lands)
        for dies in (self.relay_dies_at, self.main_dies_at):
            if dies is not None:
                at(dies, lambda: None)
        schedule()
        while events and now < 1000:
            now, _, fn = heapq.heappop(events)
            fn()
            schedule()
        res.merged, res.emitted, res.sources = merge.tokens, emitted, sources
        res.relay, res.main, res.duplicates = relay, main, merge.duplicates
        res.conflicts = merge.conflicts
        return res


@dataclass
class SimResult:
    merged: list[int] = field(default_factory=list)
    emitted: Counter[int] = field(default_factory=Counter)
    sources: dict[int, set[str]] = field(default_factory=dict)
    extends: list[int] = field(default_factory=list)
    relay: RelaySide | None = None
    main: MainSide | None = None
    duplicates: int = 0
    conflicts: int = 0


def expected(n: int) -> list[int]:
    return [token_at(i) for i in range(n)]


def random_sim(seed: int, **kw: object) -> Sim:
    rng = random.Random(seed)
    mode = rng.choice([Mode.ONE_SHOT, Mode.CATCH_UP, None])
    policy = HandoffPolicy(
        threshold=rng.choice([0, 4, 16, 64]),
        max_rounds=rng.randint(0, 6),
        force=mode,
    )
    base = dict(
        n=rng.randint(1, 250),
        policy=policy,
        budget=RelayBudget(token_budget=rng.choice([20, 80, 512]), min_budget=8),
        relay_step=rng.uniform(0.005, 0.03),
        main_step=rng.uniform(0.005, 0.03),
        extend_token=rng.uniform(0.0, 0.004),
        kv_at=rng.uniform(0.0, 3.0),
        link=Link(delay=rng.uniform(0.001, 0.05), jitter=rng.uniform(0, 0.02)),
        seed=seed,
    )
    base.update(kw)
    return Sim(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(150))
def test_clean_links_switch_atomically(seed: int) -> None:
    r = random_sim(seed).run()
    sim_n = len(r.merged)
    assert r.merged == expected(sim_n) and r.merged and r.conflicts == 0
    assert r.main is not None and r.relay is not None
    assert r.main.params.is_last(sim_n - 1, r.merged[-1])
    # each index is emitted by exactly one side: relay [0, switch_at), main after
    assert all(c == 1 for c in r.emitted.values()) and r.duplicates == 0
    if r.relay.state is RelayState.SWITCHED:
        at = r.relay.commit_at
        assert at is not None and r.main.switch_at == at
        assert all(r.sources[i] == {"relay"} for i in range(at))
        assert all(r.sources[i] == {"main"} for i in range(at, sim_n))
        assert len(r.relay.gaps) == r.relay.rounds + 1 <= r.relay.policy.max_rounds + 1
        gaps = r.relay.gaps[:-1]
        assert all(a > b for a, b in itertools.pairwise(gaps))  # strictly shrinking
        assert r.relay.tokens == r.merged[: len(r.relay.tokens)]
    else:  # the relay finished the whole output before the main decode was ready
        assert r.relay.state is RelayState.FINISHED
        assert all(s == {"relay"} for s in r.sources.values())


@pytest.mark.parametrize("seed", range(150))
def test_lossy_duplicating_reordering_links(seed: int) -> None:
    rng = random.Random(seed + 10_000)
    link = Link(
        delay=0.01, jitter=rng.uniform(0, 0.05), loss=rng.uniform(0, 0.3), dup=rng.uniform(0, 0.3)
    )
    r = random_sim(seed, link=link).run()
    assert r.merged == expected(len(r.merged)) and r.merged and r.conflicts == 0
    assert r.main is not None
    assert r.main.params.is_last(len(r.merged) - 1, r.merged[-1])


@pytest.mark.parametrize("seed", range(40))
def test_main_dead_or_absent_relay_finishes(seed: int) -> None:
    """The main decode is absent, or dies after its READY left and before the
    relay's TOKENS reach it: the relay decodes to the end."""
    rng = random.Random(seed)
    kv_at = rng.uniform(0.1, 1.0)
    kw: dict[str, object] = {"main_present": False} if seed % 2 else {"main_dies_at": kv_at + 0.03}
    sim = random_sim(seed, n=120, kv_at=kv_at, link=Link(delay=0.02), **kw)
    r = sim.run()
    assert r.merged == expected(120) and r.conflicts == 0
    assert r.relay is not None
    assert r.relay.state is RelayState.FINISHED
    assert all(s == {"relay"} for s in r.sources.values())


@pytest.mark.parametrize("seed", range(40))
def test_relay_dies_main_continues(seed: int) -> None:
    rng = random.Random(seed)
    kv_at = rng.uniform(0.1, 1.0)
    sim = random_sim(
        seed,
        n=200,
        kv_at=kv_at,
        relay_dies_at=kv_at + rng.uniform(0.0, 0.5),
        policy=HandoffPolicy(threshold=8, force=Mode.CATCH_UP),
    )
    r = sim.run()
    assert r.merged == expected(200) and r.conflicts == 0
    assert r.main is not None and r.relay is not None
    if r.relay.state is not RelayState.FINISHED:  # the relay did not finish before dying
        # the main decode emitted what it had not been handed: after the switch or its takeover
        assert r.main.state is MainState.FINISHED and r.main.switch_at is not None


def test_catch_up_rounds_within_model_bound() -> None:
    """Rounds observed with a fixed cost model stay within catch_up_rounds()."""
    checked = 0
    for kv_at in (2.0, 4.0, 8.0):
        for extend_token in (0.0005, 0.002, 0.005):
            sim = Sim(
                n=2000,
                relay_step=0.01,
                main_step=0.01,
                extend_base=0.005,
                extend_token=extend_token,
                kv_at=kv_at,
                link=Link(delay=0.02),
                policy=HandoffPolicy(threshold=16, max_rounds=50, force=Mode.CATCH_UP),
                budget=RelayBudget(token_budget=100_000),
                timeouts=HandoffTimeouts(ack_per_token=0.01),
            )
            r = sim.run()
            assert r.relay is not None and r.relay.state is RelayState.SWITCHED
            g0 = r.relay.gaps[0]
            rtt = 2 * 0.02
            bound = catch_up_rounds(g0, 16, a=(rtt + 0.005) / 0.01 + 1, rho=extend_token / 0.01)
            assert bound is not None
            assert r.relay.rounds <= bound
            assert r.merged == expected(2000)
            checked += 1
    assert checked == 9


def test_one_shot_hands_everything_in_one_extend() -> None:
    sim = Sim(n=300, kv_at=2.0, policy=HandoffPolicy(force=Mode.ONE_SHOT))
    r = sim.run()
    assert r.relay is not None and r.relay.rounds == 0 and len(r.relay.gaps) == 1
    assert r.relay.gaps[0] >= 90  # ~100 tokens generated while the KV crossed
    assert max(r.extends) == r.relay.gaps[0]  # the handed tokens in one pass (t0 was fed at READY)


def test_budget_cap_forces_handoff_and_degrades_without_main() -> None:
    p = HandoffPolicy(force=Mode.CATCH_UP)
    b = RelayBudget(token_budget=30, min_budget=8)
    # the relay stops at 30 tokens and waits (capped_wait 2 s) for the main decode
    r = Sim(n=200, kv_at=2.0, policy=p, budget=b).run()
    assert r.relay is not None and r.relay.commit_at == 30 and len(r.relay.tokens) == 30
    assert r.merged == expected(200) and r.duplicates == 0
    # the main decode is later than capped_wait: the relay keeps the request
    r = Sim(n=200, kv_at=5.0, policy=p, budget=b).run()
    assert (
        r.relay is not None and r.relay.state is RelayState.FINISHED and r.merged == expected(200)
    )
    assert r.main is not None and r.main.state is MainState.DROPPED
    r = Sim(n=200, kv_at=5.0, policy=p, budget=b, main_present=False).run()
    assert r.relay is not None and r.relay.state is RelayState.FINISHED
    assert r.merged == expected(200)
