"""Handoff policy: mode by load, the token budget, the commit rule and the
catch-up convergence bound."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import InvalidArgument
from kvbridge.handoff import HandoffPolicy, Mode, catch_up_rounds


def test_mode_by_load() -> None:
    p = HandoffPolicy(busy_load=0.6)
    assert p.choose(0.0) is Mode.CATCH_UP and p.choose(0.59) is Mode.CATCH_UP
    assert p.choose(0.6) is Mode.ONE_SHOT and p.choose(1.0) is Mode.ONE_SHOT
    assert HandoffPolicy(force=Mode.ONE_SHOT).choose(0.0) is Mode.ONE_SHOT


def test_budget_shrinks_with_load() -> None:
    p = HandoffPolicy(busy_load=0.5, token_budget=200, min_budget=20)
    assert p.budget(0.0) == p.budget(0.5) == 200
    assert p.budget(1.0) == 20
    values = [p.budget(x / 20) for x in range(21)]
    assert values == sorted(values, reverse=True)


def test_commit_rule() -> None:
    p = HandoffPolicy(threshold=64, max_rounds=3)
    assert p.should_commit(Mode.ONE_SHOT, 500, 0, None)
    assert p.should_commit(Mode.CATCH_UP, 64, 0, None)
    assert not p.should_commit(Mode.CATCH_UP, 65, 0, None)
    assert p.should_commit(Mode.CATCH_UP, 100, 1, 100)  # did not shrink
    assert not p.should_commit(Mode.CATCH_UP, 99, 1, 100)
    assert p.should_commit(Mode.CATCH_UP, 99, 3, 1000)  # round cap


def test_bad_policy() -> None:
    for kw in (
        {"threshold": -1},
        {"busy_load": 1.5},
        {"min_budget": 0},
        {"token_budget": 8, "min_budget": 9},
    ):
        with pytest.raises(InvalidArgument):
            HandoffPolicy(**kw)  # type: ignore[arg-type]


def simulate(gap: float, threshold: int, a: float, rho: float, limit: int = 10_000) -> int:
    rounds = 0
    while gap > threshold and rounds < limit:
        gap = a + rho * gap
        rounds += 1
    return rounds


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5000),
    st.integers(1, 200),
    st.floats(0, 50),
    st.floats(0, 0.99),
)
def test_round_bound_matches_the_recurrence(gap: int, threshold: int, a: float, rho: float) -> None:
    bound = catch_up_rounds(gap, threshold, a, rho)
    fixed = a / (1 - rho)
    if gap <= threshold:
        assert bound == 0
    elif fixed >= threshold:
        assert bound is None
    else:
        assert bound is not None
        # the gap sequence reaches the threshold within the bound (exact up to one round of rounding)
        sim = simulate(gap, threshold, a, rho)
        assert sim <= bound <= sim + 1


def test_geometric_example() -> None:
    # 640 tokens to hand, extend at 1/4 of a decode step per token, 8 tokens per round trip
    assert catch_up_rounds(640, 64, a=8.0, rho=0.25) == 2  # 640 -> 168 -> 50
    assert catch_up_rounds(640, 64, a=8.0, rho=1.0) is None  # an extend no cheaper than decode
    assert catch_up_rounds(640, 8, a=8.0, rho=0.0) is None  # fixed point at the threshold
    assert catch_up_rounds(640, 64, a=0.0, rho=0.0) == 1
    assert math.isclose(8.0 / 0.75, 10.666, rel_tol=1e-3)


def test_the_dynamic_budget_covers_the_expected_wait_and_no_more() -> None:
    from kvbridge.handoff import HandoffPolicy, RelaySide, RelayState, SamplingParams

    pol = HandoffPolicy(token_budget=64, min_budget=8, eta_headroom=0.5, eta_min_extra=4)
    assert pol.dynamic_budget(0.0, None) == 64  # unknown wait: the load's cap
    assert pol.dynamic_budget(0.0, 10) == 19  # 10 * 1.5 + 4
    assert pol.dynamic_budget(0.0, 0) == 4
    assert pol.dynamic_budget(0.0, 1000) == 64  # never above the load's cap
    assert pol.dynamic_budget(1.0, 1000) == 8  # which shrinks with the load
    # the relay: the main decode is expected ready 0.2 s after its start, 50 ms a step
    side = RelaySide(1, SamplingParams(0.0, max_new_tokens=100), pol)
    side.set_eta(10.2, 0.05)
    side.start(7, 10.0)
    assert side.budget(10.0) == pol.dynamic_budget(0.0, 0.2 / 0.05 + 1)
    t = 10.0
    while side.state is RelayState.DECODING:
        t += 0.05
        side.on_token(7, t)
    assert len(side.tokens) == pol.dynamic_budget(0.0, 5) == 12  # the wait, with headroom
    assert side.state is RelayState.CAPPED
    # at the cap it waits for READY until capped_wait past the expected time, then
    # (and only then) keeps the request: the main decode counts as failed
    deadline = side.next_deadline()
    assert deadline is not None and deadline >= 10.2 + side.timeouts.capped_wait - 1e-9
    assert side.poll(deadline - 0.01) == [] and not side.kept
    side.poll(deadline)
    assert side.state is RelayState.DEGRADED and side.kept
