"""End to end on the reference decoder: prefill, relay decode, main decode and
the client in one process over an in-memory network.  The client's stream
must equal one decoder decoding the same prompt alone, for random prompts,
handoff points, thresholds and modes, greedy and seeded sampling, under
injected delays, duplicates, reordering and loss; and in the failure cases."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvbridge.handoff import (
    HandoffPolicy,
    HandoffTimeouts,
    MainState,
    Mode,
    RelayState,
    SamplingParams,
)
from kvbridge.handoff.driver import Pace
from kvbridge.pdd import RelayBudget
from kvbridge_bench.reference import DecoderConfig, ReferenceDecoder
from kvbridge_bench.sim.handoff_scenario import Scenario, ScenarioResult, decode_alone, run_scenario
from kvbridge_bench.sim.network import LinkModel

CFG = DecoderConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    seed=11,
)
FAST = HandoffTimeouts(
    ack_timeout=0.05,
    ack_per_token=0.001,
    max_retries=2,
    capped_wait=0.3,
    ready_retry=0.05,
    relay_timeout=0.4,
)


@pytest.fixture(scope="module")
def decoders() -> tuple[ReferenceDecoder, ReferenceDecoder, ReferenceDecoder]:
    # three engines, three cache layouts: pages are copied across layouts
    p = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=16), 64)
    r = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=8, order="page_first"), 128)
    m = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=32, head_order="HND"), 32)
    return p, r, m


def run(sc: Scenario, decoders: tuple[ReferenceDecoder, ...]) -> ScenarioResult:
    async def main() -> ScenarioResult:
        return await asyncio.wait_for(run_scenario(sc, *decoders), 30)

    res = asyncio.run(main())
    for d in decoders:  # every request was freed
        assert d.allocator.free_count == d.allocator.num_pages
    return res


def alone(decoders: tuple[ReferenceDecoder, ...], sc: Scenario) -> list[int]:
    return decode_alone(decoders[0], 99, list(sc.prompt), sc.params)


def random_case(seed: int, **kw: object) -> Scenario:
    rng = random.Random(seed)
    sampled = seed % 2 == 1
    params = SamplingParams(
        temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
        top_k=rng.choice([0, 20]),
        top_p=rng.choice([1.0, 0.9]),
        seed=rng.randrange(2**64),
        max_new_tokens=rng.randint(10, 70),
    )
    base: dict[str, object] = dict(
        prompt=tuple(rng.randrange(CFG.vocab_size) for _ in range(rng.randint(1, 50))),
        params=params,
        policy=HandoffPolicy(
            threshold=rng.choice([2, 8, 64]),
            max_rounds=rng.randint(0, 4),
            force=rng.choice([Mode.ONE_SHOT, Mode.CATCH_UP]),
        ),
        timeouts=FAST,
        main_kv_delay=rng.uniform(0.0, 0.02),
        handoff_after=rng.randint(1, params.max_new_tokens + 3),
        relay_pace=Pace(decode_s=0.002),
        peer_link=LinkModel(delay=rng.uniform(0.0, 0.01), jitter=0.002),
        client_link=LinkModel(delay=0.001, jitter=0.003),
        seed=seed,
    )
    base.update(kw)
    return Scenario(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(12))
def test_stream_equals_decoding_alone(seed: int, decoders: tuple[ReferenceDecoder, ...]) -> None:
    sc = random_case(seed)
    res = run(sc, decoders)
    assert res.stream.tokens == alone(decoders, sc)
    assert res.stream.conflicts == 0 and not res.errors
    assert res.relay is not None and res.main is not None
    if res.relay.state is RelayState.SWITCHED:
        assert res.main.switch_at == res.relay.commit_at and res.stream.duplicates == 0
    else:
        assert res.relay.state is RelayState.FINISHED and res.main.state is MainState.DROPPED


@pytest.mark.parametrize("seed", range(6))
def test_faulty_links_exactly_once(seed: int, decoders: tuple[ReferenceDecoder, ...]) -> None:
    rng = random.Random(seed)
    peer = LinkModel(
        delay=0.003,
        jitter=0.004,
        loss=rng.uniform(0.05, 0.3),
        duplicate=0.3,
        reorder=0.3,
        reorder_delay=0.01,
    )
    client = LinkModel(delay=0.001, jitter=0.004, duplicate=0.3, reorder=0.3, reorder_delay=0.01)
    sc = random_case(seed + 100, peer_link=peer, client_link=client)
    res = run(sc, decoders)
    assert res.stream.tokens == alone(decoders, sc)
    assert res.stream.conflicts == 0 and "main" not in res.errors


def test_one_shot_and_catch_up(decoders: tuple[ReferenceDecoder, ...]) -> None:
    base = dict(
        prompt=tuple(range(30)),
        params=SamplingParams(max_new_tokens=120),
        timeouts=FAST,
        main_kv_delay=0.0,
        handoff_after=40,
        relay_pace=Pace(decode_s=0.003),
        main_pace=Pace(extend_token_s=0.001),
        peer_link=LinkModel(delay=0.01),
    )
    one = run(Scenario(policy=HandoffPolicy(force=Mode.ONE_SHOT), **base), decoders)  # type: ignore[arg-type]
    cat = run(Scenario(policy=HandoffPolicy(threshold=8, force=Mode.CATCH_UP), **base), decoders)  # type: ignore[arg-type]
    want = alone(
        decoders, Scenario(prompt=tuple(range(30)), params=SamplingParams(max_new_tokens=120))
    )
    assert one.stream.tokens == cat.stream.tokens == want
    assert one.relay is not None and cat.relay is not None
    assert one.relay.rounds == 0 and len(one.relay.gaps) == 1 and one.relay.gaps[0] >= 39
    assert cat.relay.rounds >= 1 and cat.relay.gaps[0] >= 39 > cat.relay.gaps[-1]


def test_policy_by_load(decoders: tuple[ReferenceDecoder, ...]) -> None:
    base = dict(
        prompt=(1, 2, 3),
        params=SamplingParams(max_new_tokens=60),
        timeouts=FAST,
        main_kv_delay=0.0,
        handoff_after=20,
        relay_pace=Pace(decode_s=0.002),
        policy=HandoffPolicy(threshold=4, busy_load=0.5),
    )
    busy = run(Scenario(relay_load=0.9, **base), decoders)  # type: ignore[arg-type]
    idle = run(Scenario(relay_load=0.1, **base), decoders)  # type: ignore[arg-type]
    assert busy.relay is not None and busy.relay.mode is Mode.ONE_SHOT
    assert idle.relay is not None and idle.relay.mode is Mode.CATCH_UP
    assert busy.stream.tokens == idle.stream.tokens


def test_budget_cap_forces_handoff(decoders: tuple[ReferenceDecoder, ...]) -> None:
    sc = random_case(
        3,
        params=SamplingParams(max_new_tokens=60),
        handoff_after=12,
        main_kv_delay=0.1,
        policy=HandoffPolicy(force=Mode.CATCH_UP),
        budget=RelayBudget(token_budget=12, min_budget=4),
    )
    res = run(sc, decoders)
    assert res.relay is not None and res.relay.commit_at == 12 and len(res.relay.tokens) == 12
    assert res.stream.tokens == alone(decoders, sc)


@pytest.mark.parametrize("main", ["absent", "dies"])
def test_main_unreachable_or_dead_relay_finishes(
    main: str, decoders: tuple[ReferenceDecoder, ...]
) -> None:
    sc = random_case(
        5,
        params=SamplingParams(max_new_tokens=50, temperature=0.8, seed=3),
        main=main,
        main_kv_delay=0.0,
        handoff_after=5,
        relay_pace=Pace(decode_s=0.004),
        policy=HandoffPolicy(force=Mode.CATCH_UP, threshold=2),
        budget=RelayBudget(token_budget=20, min_budget=4),
    )
    res = run(sc, decoders)
    assert res.stream.tokens == alone(decoders, sc)
    assert res.relay is not None and res.relay.state is RelayState.FINISHED


def test_main_slow_relay_leaves_the_last_token_to_it(
    decoders: tuple[ReferenceDecoder, ...],
) -> None:
    """The main decode is slow but alive: the relay stops short of the last
    token and hands over (P-RLD is excluded); only with ``leave_last=False``
    does a fast relay finish the request alone."""
    import dataclasses

    sc = random_case(
        6, params=SamplingParams(max_new_tokens=15), handoff_after=None, main_kv_delay=0.2
    )
    sc = dataclasses.replace(sc, timeouts=dataclasses.replace(FAST, capped_wait=2.0))
    res = run(sc, decoders)
    assert res.stream.tokens == alone(decoders, sc)
    assert res.relay is not None and res.relay.state is RelayState.SWITCHED
    assert not res.relay.kept and len(res.relay.tokens) < 15
    assert res.main is not None and res.main.state is MainState.FINISHED
    old = dataclasses.replace(
        sc, budget=dataclasses.replace(sc.budget, leave_last=False), main_kv_delay=1.5
    )
    res = run(old, decoders)
    assert res.stream.tokens == alone(decoders, sc)
    assert res.relay is not None and res.relay.state is RelayState.FINISHED
    assert res.main is not None and res.main.state is MainState.DROPPED


@pytest.mark.parametrize("after", [1, 2])
def test_relay_dies_main_continues(after: int, decoders: tuple[ReferenceDecoder, ...]) -> None:
    sc = random_case(
        7,
        params=SamplingParams(max_new_tokens=80),
        main_kv_delay=0.0,
        handoff_after=30,
        relay_dies_after=after,
        policy=HandoffPolicy(threshold=2, force=Mode.CATCH_UP),
        relay_pace=Pace(decode_s=0.003),
    )
    res = run(sc, decoders)
    assert res.stream.tokens == alone(decoders, sc)
    assert "relay" in res.errors  # its node died under it
    assert res.main is not None and res.main.state is MainState.FINISHED


def test_p_md_pipeline_without_relay(decoders: tuple[ReferenceDecoder, ...]) -> None:
    from kvbridge.handoff.driver import prefill_request
    from kvbridge.handoff.node import HandoffNode
    from kvbridge.pdd.aio import collect_stream, run_main
    from kvbridge_bench.sim.network import MemoryNetwork

    p, _, m = decoders
    params = SamplingParams(max_new_tokens=25, temperature=1.0, seed=5)
    spec = prefill_request(p, 1, [5, 6, 7], params)
    wire = p.read_kv(1, 0, 3)
    p.free(1)

    async def load(engine: ReferenceDecoder, s: object) -> None:
        engine.allocate(1)
        engine.append_cached(1, [5, 6, 7])
        engine.write_kv(1, 0, wire)

    async def go() -> list[int]:
        net = MemoryNetwork()
        async with HandoffNode(net.node("main")) as mn, HandoffNode(net.node("client")) as cn:
            stream, _ = await asyncio.gather(
                collect_stream(cn, 1, idle_timeout=5),
                run_main(m, spec, mn, load, relay=None, client="client"),  # type: ignore[arg-type]
            )
        net.close()
        return stream.tokens

    assert asyncio.run(asyncio.wait_for(go(), 20)) == decode_alone(p, 2, [5, 6, 7], params)
