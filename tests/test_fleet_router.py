"""The fleet router core: prefix-aware main decodes bounded by load, session
affinity, prefill by queued work, the pipeline from kvbridge.router, ejection
and re-admission, re-routing of requests in flight on a dead engine; and a
short churn on a real etcd in which no request is lost."""

from __future__ import annotations

import asyncio
import random

import pytest
from etcd_server import EtcdServer
from fleet_reference import FleetRouter as RefRouter

from kvbridge.cache.hashing import page_hashes
from kvbridge.errors import Unavailable
from kvbridge.fleet import FleetConfig, FleetRouter
from kvbridge.layout import KVLayout
from kvbridge.registry import (
    EngineRecord,
    LoadReport,
    RegistryView,
    Role,
    ViewChange,
    new_generation,
)
from kvbridge.registry.etcd import EtcdOptions, EtcdRegistration, EtcdWatcher
from kvbridge.router import Pipeline, Reason, Router, RouterConfig

PT = 16


def rec(eid: str, role: Role, queued: int = 0, gen: str | None = None) -> EngineRecord:
    return EngineRecord(
        engine_id=eid, role=role, datacenter="dc", model="m", compat_hash=1,
        generation=gen or new_generation(), endpoints={"tcp": "127.0.0.1:1"},
        load=LoadReport(queued_tokens=queued),
    )  # fmt: skip


def fleet(n_p: int = 2, n_r: int = 1, n_m: int = 3, **cfg: float) -> FleetRouter:
    fr = FleetRouter(Router(_layout()), FleetConfig(page_tokens=PT, **cfg))  # type: ignore[arg-type]
    for i in range(n_p):
        fr.apply(ViewChange(f"p{i}", rec(f"p{i}", Role.PREFILL), None))
    for i in range(n_r):
        fr.apply(ViewChange(f"r{i}", rec(f"r{i}", Role.RELAY), None))
    for i in range(n_m):
        fr.apply(ViewChange(f"m{i}", rec(f"m{i}", Role.MAIN), None))
    return fr


def _layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=PT)


def test_longest_prefix_wins_and_sessions_stick() -> None:
    fr = fleet()
    a = list(range(64))
    first = fr.route("r1", a, 10)
    fr.finish("r1")
    # a request extending a's prefix goes where a went
    assert fr.route("r2", a + [7] * 32, 10).main == first.main
    fr.finish("r2")
    s = fr.route("s1", list(range(1000, 1032)), 5, session="agent")
    fr.finish("s1")
    assert fr.route("s2", list(range(5000, 5032)), 5, session="agent").main == s.main


def test_load_bound_spreads_one_hot_prefix() -> None:
    fr = fleet(n_m=4, load_factor=1.5)
    hot = list(range(48))
    mains = [fr.route(f"q{i}", hot, 10).main for i in range(40)]
    counts = {m: mains.count(m) for m in set(mains)}
    assert len(counts) == 4 and max(counts.values()) <= 1.5 * 40 / 4 + 1


def test_prefill_by_queued_work() -> None:
    fr = fleet(n_p=0)
    fr.apply(ViewChange("busy", rec("busy", Role.PREFILL, queued=100000), None))
    fr.apply(ViewChange("idle", rec("idle", Role.PREFILL, queued=0), None))
    assert fr.route("x", list(range(32)), 1).prefill == "idle"


def test_a_sessions_next_turn_keeps_its_prefill_once_the_last_prefill_is_done() -> None:
    """Two sessions on two prefills. A's first turn has been prefilled and is
    still decoding, B's first turn has ended; A's second turn extends A's
    first prompt. Its prefill holds that prompt, and with the prompt no longer
    queued there (``prefilled``) the turn stays on it. Counting the prompt as
    queued until ``finish`` (the behaviour before ``prefilled``) sent it to
    B's idle prefill, where its prompt is cold: A's own prefill was "busy"
    with A's previous turn by more than the pages it holds (4 tokens of a
    partial page past 96 held)."""
    fr = fleet(n_p=2, n_r=0, n_m=2)
    a1 = [1000 + i for i in range(100)]
    first = fr.route("a1", a1, 500, session="A")
    b1 = fr.route("b1", [2000 + i for i in range(100)], 5, session="B")
    assert b1.prefill != first.prefill  # A's prompt queued on its prefill
    fr.prefilled("a1")
    fr.prefilled("b1")
    fr.finish("b1")  # B's turn ended; A's first turn is still decoding
    a2 = fr.route("a2", a1 + [3000 + i for i in range(40)], 50, session="A")
    assert a2.prefill == first.prefill
    assert fr.inflight == 2


def test_prefilled_releases_the_queue_once_and_finish_the_rest() -> None:
    fr = fleet(n_p=1, n_r=0, n_m=1)
    core, p, m = fr._core, fr._slots["p0"], fr._slots["m0"]
    fr.route("x", list(range(64)), 10)
    fr.route("y", list(range(100, 132)), 10)
    assert core.queued(p) == 96 and core.active(p) == 2 and core.active(m) == 2
    fr.prefilled("x")
    assert core.queued(p) == 32 and core.active(p) == 2  # still in flight
    fr.prefilled("x")  # idempotent
    fr.prefilled("nobody")  # not in flight: ignored, as finish ignores it
    assert core.queued(p) == 32 and fr.inflight == 2
    fr.finish("x")  # the rest: in flight on the prefill and the main decode
    assert core.queued(p) == 32 and core.active(p) == 1 and core.active(m) == 1
    fr.prefilled("x")  # finished: ignored
    fr.finish("y")  # never reported prefilled: finish releases its queue
    assert core.queued(p) == 0 and core.active(p) == 0 and core.active(m) == 0


def test_a_prefilled_request_rerouted_to_another_prefill_is_queued_there() -> None:
    fr = fleet(n_p=2, n_r=0, n_m=1)
    r = fr.route("x", list(range(64)), 10)
    fr.prefilled("x")
    assert fr._core.queued(fr._slots[r.prefill]) == 0
    (rp,) = fr.apply(ViewChange(r.prefill, None, None))
    assert rp.stage == "prefill"
    core, new = fr._core, fr._slots[rp.engine]
    assert core.queued(new) == 64  # to be prefilled again there
    fr.prefilled("x")
    assert core.queued(new) == 0 and core.active(new) == 1
    fr.finish("x")
    assert core.queued(new) == 0 and core.active(new) == 0


def test_pipeline_is_the_routers() -> None:
    layout = _layout()
    fr = FleetRouter(Router(layout, RouterConfig(ttft_target_s=1e-9)), FleetConfig(page_tokens=PT))
    for eid, role in (("p", Role.PREFILL), ("r", Role.RELAY), ("m", Role.MAIN)):
        fr.apply(ViewChange(eid, rec(eid, role), None))
    route = fr.route("x", list(range(4096)), 2000)
    assert route.decision.pipeline is Pipeline.P_RLD_MD and route.relay == "r"
    fr2 = fleet()
    assert fr2.route("y", list(range(32)), 1).relay is None


def test_ejection_and_readmission() -> None:
    fr = fleet(n_m=2, max_failures=2)
    for i in range(2):
        r = fr.route(f"f{i}", list(range(i * 100, i * 100 + 32)), 1, session="s")
        fr.finish(f"f{i}", failed_on=r.main)
    bad = r.main
    assert bad not in fr.eligible(Role.MAIN)
    assert all(fr.route(f"g{i}", [i] * 32, 1).main != bad for i in range(5))
    # registers again (new generation): taken back
    fr.apply(ViewChange(bad, rec(bad, Role.MAIN), fr._records[bad]))
    assert bad in fr.eligible(Role.MAIN)


def test_reroute_on_death() -> None:
    fr = fleet(n_p=2, n_m=2)
    r = fr.route("x", list(range(64)), 1)
    (rr,) = fr.apply(ViewChange(r.main, None, None))
    assert rr.stage == "main" and rr.engine != r.main and rr.engine.startswith("m")
    (rp,) = fr.apply(ViewChange(r.prefill, None, None))
    assert rp.stage == "prefill" and rp.engine != r.prefill
    # the last main decode gone: nothing to route to, a typed error
    fr.apply(ViewChange(rr.engine, None, None))
    with pytest.raises(Unavailable):
        fr.route("y", [1] * 16, 1)


def test_churn_loses_no_request(etcd: EtcdServer) -> None:
    """Engines join and leave (every 0.3 s for 4 s) while requests are routed;
    every request completes, on a re-route when its engine leaves."""

    async def go() -> None:
        opts = EtcdOptions(port=etcd.port, retry_s=0.1)
        fr = FleetRouter(Router(_layout()), FleetConfig(page_tokens=PT))
        pending: list = []
        view = RegistryView(on_change=lambda ch: pending.extend(fr.apply(ch)))
        watcher = EtcdWatcher(view, opts)
        await watcher.start()
        regs: dict[str, EtcdRegistration] = {}

        async def join(eid: str, role: Role) -> None:
            reg = EtcdRegistration(rec(eid, role), opts, ttl_s=2)
            await reg.start()
            regs[eid] = reg

        for i in range(4):
            await join(f"p{i}", Role.PREFILL)
            await join(f"m{i}", Role.MAIN)
        while len(view) < 8:
            await asyncio.sleep(0.05)
        rng = random.Random(5)
        done: set[str] = set()
        routed: dict[str, object] = {}
        n = 0
        loop = asyncio.get_running_loop()
        end = loop.time() + 4.0
        next_churn = loop.time()
        while loop.time() < end:
            if loop.time() >= next_churn:
                next_churn += 0.3
                role = rng.choice([Role.PREFILL, Role.MAIN])
                mine = sorted(e for e in regs if regs[e].record.role is role)
                if len(mine) > 2 and rng.random() < 0.5:
                    victim = rng.choice(mine)
                    await regs.pop(victim).close()
                else:
                    await join(f"{role.value[0]}x{n}", role)
            rid = f"q{n}"
            n += 1
            routed[rid] = fr.route(rid, [rng.randrange(100)] * 32, 4)
            # the oldest in-flight request completes
            if len(routed) - len(done) > 8:
                old = next(r for r in routed if r not in done)
                # not lost: its engines are live ones (re-routed if one left)
                now = fr._inflight[old]
                assert view.get(now.prefill) is not None and view.get(now.main) is not None
                fr.finish(old)
                done.add(old)
            await asyncio.sleep(0.01)
        for rid in routed:
            if rid not in done:
                fr.finish(rid)
                done.add(rid)
        assert done == set(routed) and fr.inflight == 0
        assert n > 50
        for reg in regs.values():
            await reg.close()
        await watcher.close()

    asyncio.run(asyncio.wait_for(go(), 60))


def _brute_depth(fr: FleetRouter, eid: str, hashes: list[bytes]) -> int:
    pages = set(fr._core.pages(fr._slots[eid]))
    n = 0
    for h in hashes:
        if h not in pages:
            break
        n += 1
    return n


@pytest.mark.parametrize("seed", range(6))
def test_choices_equal_a_brute_force_scan(seed: int) -> None:
    """The bit-set index, the load buckets and the heaps choose what a scan
    of every engine would: the main decode with the longest held prefix
    among those within the cap (the least loaded on a tie, all of them when
    none fits), and the prefill with the least queued work less its prefix."""
    rng = random.Random(seed)
    fr = FleetRouter(Router(_layout()), FleetConfig(page_tokens=PT, load_factor=1.2))
    for i in range(rng.randrange(1, 6)):
        queued = rng.randrange(0, 200)
        fr.apply(ViewChange(f"p{i}", rec(f"p{i}", Role.PREFILL, queued=queued), None))
    fr.apply(ViewChange("r0", rec("r0", Role.RELAY), None))
    for i in range(rng.randrange(1, 7)):
        fr.apply(ViewChange(f"m{i}", rec(f"m{i}", Role.MAIN), None))
    bases = [[rng.randrange(50) for _ in range(8 * PT)] for _ in range(4)]
    inflight: list[str] = []
    for k in range(300):
        toks = rng.choice(bases)[: rng.randrange(PT, 8 * PT)]
        toks += [rng.randrange(50) for _ in range(rng.randrange(0, 3 * PT))]
        hashes = page_hashes(toks, PT)
        mains = fr.eligible(Role.MAIN)
        actives = {m: fr._core.active(fr._slots[m]) for m in mains}
        cap = fr.config.load_factor * (sum(actives.values()) + 1) / len(mains)
        fits = [m for m in mains if actives[m] + 1 <= cap] or mains
        depth = {m: _brute_depth(fr, m, hashes) for m in mains}
        best_main = max((depth[m], -actives[m]) for m in fits)
        pre = {
            p: fr._core.queued(fr._slots[p]) - _brute_depth(fr, p, hashes) * PT
            for p in fr.eligible(Role.PREFILL)
        }
        route = fr.route(f"q{k}", toks, 4)
        assert route.main in fits
        assert (depth[route.main], -actives[route.main]) == best_main
        assert route.matched_tokens == min(depth[route.main] * PT, len(toks))
        assert pre[route.prefill] == min(pre.values())
        inflight.append(route.request_id)
        if len(inflight) > rng.randrange(1, 20):
            fr.finish(inflight.pop(rng.randrange(len(inflight))))
        if k % 50 == 49:  # membership moves: an engine leaves, another joins
            gone = rng.choice(fr.eligible(Role.MAIN))
            if len(fr.eligible(Role.MAIN)) > 1:
                fr.apply(ViewChange(gone, None, None))
            fr.apply(ViewChange(f"m{k}", rec(f"m{k}", Role.MAIN), None))


def test_new_prefixes_spread_over_equal_engines_and_no_relay_means_p_md() -> None:
    fr = fleet(n_m=2)
    a = fr.route("a", list(range(64)), 4, session="A")
    fr.finish("a")
    b = fr.route("b", list(range(500, 564)), 4, session="B")
    fr.finish("b")
    assert {a.main, b.main} == {"m0", "m1"}  # equal engines: in turn, not both on one
    # each session's next turn stays where its prefix is
    assert fr.route("a2", list(range(64)) + [9] * 32, 4, session="A").main == a.main
    assert fr.route("b2", list(range(500, 564)) + [9] * 32, 4, session="B").main == b.main
    # the router would relay, but the fleet has no relay: P-MD, said why
    layout = _layout()
    lone = FleetRouter(
        Router(layout, RouterConfig(ttft_target_s=1e-9)), FleetConfig(page_tokens=PT)
    )
    for eid, role in (("p", Role.PREFILL), ("m", Role.MAIN)):
        lone.apply(ViewChange(eid, rec(eid, role), None))
    route = lone.route("x", list(range(4096)), 2000)
    assert route.relay is None and route.decision.pipeline is Pipeline.P_MD
    assert route.decision.reason is Reason.NO_RELAY


def _state(fr: FleetRouter) -> dict[str, tuple[int, int, list[bytes]]]:
    return {
        eid: (fr._core.active(s), fr._core.queued(s), fr._core.pages(s))
        for eid, s in fr._slots.items()
    }


def _ref_state(ref: RefRouter) -> dict[str, tuple[int, int, list[bytes]]]:
    return {eid: (e.active, e.queued, list(e.pages)) for eid, e in ref._engines.items()}


@pytest.mark.parametrize("seed", range(10))
def test_decisions_equal_the_python_router_they_replaced(seed: int) -> None:
    """The compiled core (csrc/fleet/) decides what the pure-Python router it
    replaced decides (tests/fleet_reference.py, kept as it was), tie-breaks
    included: every route, re-route and refusal, the eligible engines, and
    each engine's load and its prefix index in LRU order, through random
    traffic with sessions, prefills reported done (twice at times, and for
    ids not in flight), failures and ejections, load reports with
    prefixes, restarts, engines leaving and joining, and small per-engine
    page limits (evictions). A fleet has relays or one engine serving relay
    and main (the old router's order of two relay-heap pushes in one request
    followed Python's set order, which varies by process)."""
    rng = random.Random(seed)
    cfg = FleetConfig(
        page_tokens=PT,
        load_factor=rng.choice([1.0, 1.2, 1.5, 3.0]),
        max_failures=2,
        max_pages_per_engine=rng.choice([6, 40, 65536]),
    )
    new = FleetRouter(Router(_layout(), RouterConfig(ttft_target_s=0.4)), cfg)
    ref = RefRouter(Router(_layout(), RouterConfig(ttft_target_s=0.4)), cfg)
    bases = [[rng.randrange(40) for _ in range(10 * PT)] for _ in range(5)]
    both_role = rng.random() < 0.3
    born = 0

    def record(eid: str, role: Role, gen: str | None = None) -> EngineRecord:
        base = rng.choice(bases)
        prefixes = (
            tuple(page_hashes(base[: rng.randrange(0, 6) * PT], PT)) if rng.random() < 0.4 else ()
        )
        return EngineRecord(
            engine_id=eid, role=role, datacenter="dc", model="m", compat_hash=1,
            generation=gen or new_generation(), endpoints={"tcp": "127.0.0.1:1"},
            load=LoadReport(queued_tokens=rng.randrange(0, 300), active_transfers=rng.randrange(0, 3)),
            prefixes=prefixes,
        )  # fmt: skip

    def apply(change: ViewChange) -> None:
        got, want = new.apply(change), ref.apply(change)
        assert [(r.request_id, r.stage, r.engine) for r in got] == [
            (r.request_id, r.stage, r.engine) for r in want
        ]

    def join(role: Role) -> None:
        nonlocal born
        born += 1
        eid = f"{role.value[0]}{born}"
        apply(ViewChange(eid, record(eid, role), None))

    for _ in range(rng.randrange(1, 6)):
        join(Role.PREFILL)
    if both_role:
        join(Role.BOTH)
    else:
        for _ in range(rng.randrange(0, 3)):
            join(Role.RELAY)
    for _ in range(rng.randrange(1, 7)):
        join(Role.MAIN)
    inflight: list[str] = []
    for k in range(700):
        op = rng.random()
        if op < 0.55:
            toks = rng.choice(bases)[: rng.randrange(0, 10 * PT)]
            toks += [rng.randrange(40) for _ in range(rng.randrange(0, 3 * PT))]
            session = f"s{rng.randrange(6)}" if rng.random() < 0.5 else None
            out = rng.randrange(1, 300)
            try:
                got = new.route(f"q{k}", toks, out, session=session)
            except Unavailable as e:
                with pytest.raises(Unavailable, match=str(e)):
                    ref.route(f"q{k}", toks, out, session=session)
                continue
            want = ref.route(f"q{k}", toks, out, session=session)
            assert (got.prefill, got.relay, got.main, got.matched_tokens, got.decision) == (
                want.prefill, want.relay, want.main, want.matched_tokens, want.decision
            )  # fmt: skip
            inflight.append(got.request_id)
        elif op < 0.68 and inflight:  # a prefill ends (again, at times); the request stays
            rid = rng.choice([*inflight, "gone"])
            new.prefilled(rid)
            ref.prefilled(rid)
        elif op < 0.85 and inflight:
            rid = inflight.pop(rng.randrange(len(inflight)))
            route = new._inflight[rid]
            failed_on = rng.choice([None, None, None, route.prefill, route.main, route.relay])
            new.finish(rid, failed_on=failed_on)
            ref.finish(rid, failed_on=failed_on)
        else:
            eid = rng.choice(sorted(ref._engines)) if ref._engines else None
            what = rng.random()
            if eid is None or what < 0.3:
                join(rng.choice([Role.PREFILL, Role.MAIN] + ([] if both_role else [Role.RELAY])))
            elif what < 0.6:  # a new load report (and prefixes)
                old = ref._engines[eid].record
                apply(ViewChange(eid, record(eid, old.role, old.generation), old))
            elif what < 0.8:  # restarted: a new generation
                old = ref._engines[eid].record
                apply(ViewChange(eid, record(eid, old.role), old))
            else:
                apply(ViewChange(eid, None, ref._engines[eid].record))
        assert new.inflight == ref.inflight
        if k % 25 == 0:
            for role in (Role.PREFILL, Role.RELAY, Role.MAIN):
                assert new.eligible(role) == ref.eligible(role)
            assert _state(new) == _ref_state(ref)
    assert _state(new) == _ref_state(ref)


def test_decisions_equal_the_python_router_past_64_and_128_engines() -> None:
    """The same comparison while the fleet grows past 64 and 128 engines
    (the core's bit sets widen with the index already full of pages) and
    shrinks again: routes, re-routes, eligible engines, loads, LRU orders."""
    rng = random.Random(7)
    cfg = FleetConfig(page_tokens=PT, load_factor=1.2, max_pages_per_engine=50)
    new = FleetRouter(Router(_layout(), RouterConfig(ttft_target_s=0.4)), cfg)
    ref = RefRouter(Router(_layout(), RouterConfig(ttft_target_s=0.4)), cfg)
    bases = [[rng.randrange(40) for _ in range(10 * PT)] for _ in range(8)]

    def apply(change: ViewChange) -> None:
        got, want = new.apply(change), ref.apply(change)
        assert [(r.request_id, r.stage, r.engine) for r in got] == [
            (r.request_id, r.stage, r.engine) for r in want
        ]

    def check() -> None:
        for role in (Role.PREFILL, Role.RELAY, Role.MAIN):
            assert new.eligible(role) == ref.eligible(role)
        assert _state(new) == _ref_state(ref)

    inflight: list[str] = []
    k = 0
    for wave in range(4):  # 40 engines a wave: 40, 80, 120, 160
        for i in range(40):
            role = (Role.PREFILL, Role.MAIN, Role.MAIN, Role.RELAY)[i % 4]
            eid = f"{role.value[0]}{wave}-{i}"
            apply(ViewChange(eid, rec(eid, role, queued=rng.randrange(0, 200)), None))
        for _ in range(150):
            k += 1
            toks = rng.choice(bases)[: rng.randrange(PT, 10 * PT)] + [rng.randrange(40)] * PT
            session = f"s{rng.randrange(10)}" if rng.random() < 0.5 else None
            got = new.route(f"q{k}", toks, 50, session=session)
            want = ref.route(f"q{k}", toks, 50, session=session)
            assert (got.prefill, got.relay, got.main, got.matched_tokens, got.decision) == (
                want.prefill, want.relay, want.main, want.matched_tokens, want.decision
            )  # fmt: skip
            inflight.append(got.request_id)
            if rng.random() < 0.5:
                rid = rng.choice(inflight)
                new.prefilled(rid)
                ref.prefilled(rid)
            if len(inflight) > 30:
                rid = inflight.pop(rng.randrange(len(inflight)))
                new.finish(rid)
                ref.finish(rid)
        check()
    for eid in sorted(ref._engines)[::2]:  # half the fleet leaves
        apply(ViewChange(eid, None, ref._engines[eid].record))
    check()
