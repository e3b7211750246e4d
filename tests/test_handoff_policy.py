"""Handoff policy: mode by load, the commit rule and the catch-up
convergence bound (the relay's budget: tests/test_pdd_core.py)."""

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
        {"max_rounds": -1},
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
