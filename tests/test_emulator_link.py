"""The emulator's parameters, parsers and link model (no network needed)."""

from __future__ import annotations

import random

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge_bench.sim.emulator import (
    Link,
    LinkParams,
    parse_fraction,
    parse_rate,
    parse_size,
    parse_time,
)
from kvbridge_bench.sim.emulator.__main__ import split_commands
from kvbridge_bench.sim.emulator.tcpproxy import parse_hostport


@pytest.mark.parametrize(
    ("text", "value"),
    [("1gbit", 1e9), ("500mbit", 5e8), ("100kbit", 1e5), ("2.5G", 2.5e9), ("1mbps", 8e6), (7, 7.0)],
)
def test_parse_rate(text: str, value: float) -> None:
    assert parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("text", "value"), [("40ms", 0.04), ("1s", 1.0), ("250us", 0.00025), ("20", 0.02)]
)
def test_parse_time(text: str, value: float) -> None:
    assert parse_time(text) == pytest.approx(value)


def test_parse_size_and_fraction() -> None:
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("1MB") == 1_000_000
    assert parse_size("123") == 123
    assert parse_fraction("0.1%") == pytest.approx(0.001)
    assert parse_fraction("0.02") == pytest.approx(0.02)


@pytest.mark.parametrize("bad", ["fast", "1 lightyear", "", "1.2.3gbit", "-5mbit"])
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_rate(bad)


def test_parse_fraction_and_hostport_reject() -> None:
    with pytest.raises(InvalidArgument):
        parse_fraction("lots")
    with pytest.raises(InvalidArgument):
        parse_hostport("localhost")
    with pytest.raises(InvalidArgument):
        parse_hostport("h:99999")
    assert parse_hostport("[::1]:80") == ("::1", 80)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate_bps": -1},
        {"delay_s": -0.1},
        {"delay_s": float("nan")},
        {"jitter_s": -1},
        {"loss": 1.0},
        {"loss": -0.1},
        {"queue_bytes": 0},
    ],
)
def test_link_params_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        LinkParams(**kwargs)  # type: ignore[arg-type]


def test_link_params_dict_round_trip() -> None:
    p = LinkParams(rate_bps=5e6, delay_s=0.01, loss=0.01, queue_bytes=9000)
    assert LinkParams.from_dict(p.to_dict()) == p
    with pytest.raises(InvalidArgument):
        LinkParams.from_dict({"rate": 1})


def test_default_queue_is_one_bdp() -> None:
    p = LinkParams(rate_bps=1e9, delay_s=0.02)
    assert p.resolved_queue(mtu=65000, rtt_s=0.04) == 5_000_000
    # never below a few packets
    assert LinkParams(rate_bps=1e6).resolved_queue(mtu=65000, rtt_s=0.001) == 4 * 65000


def test_serializer_spaces_packets_at_line_rate() -> None:
    # 8 Mbit/s: 1000 bytes take 1 ms; delay 10 ms
    link = Link(LinkParams(rate_bps=8e6, delay_s=0.010, queue_bytes=10**6), 1500, 0.02)
    dues = [link.offer(0.0, 1000) for _ in range(5)]
    assert dues == pytest.approx([0.011, 0.012, 0.013, 0.014, 0.015])
    # an idle line starts fresh
    assert link.offer(1.0, 1000) == pytest.approx(1.011)


def test_tail_drop_when_queue_full() -> None:
    link = Link(LinkParams(rate_bps=8e6, delay_s=0.0, queue_bytes=3000), 1500, 0.0)
    results = [link.offer(0.0, 1000) for _ in range(5)]
    assert [r is not None for r in results] == [True, True, True, False, False]
    assert link.stats.dropped_queue == 2
    assert link.stats.max_queue_bytes == 3000
    # after 1 ms one packet has left: one more fits
    assert link.offer(0.001, 1000) is not None
    assert link.offer(0.001, 1000) is None


def test_queue_never_exceeds_bound_and_rate_is_kept() -> None:
    rng = random.Random(3)
    link = Link(LinkParams(rate_bps=1e8, delay_s=0.005, queue_bytes=50_000), 9000, 0.01)
    now, accepted = 0.0, 0
    for _ in range(5000):
        now += rng.random() * 0.0002
        size = rng.randint(40, 9000)
        if link.offer(now, size) is not None:
            accepted += size
        assert link.queued_bytes(now) <= 50_000
    # bytes that left the serializer cannot exceed rate x time + the queue
    assert accepted <= 1e8 / 8 * now + 50_000
    assert link.stats.dropped_queue > 0


def test_loss_is_random_and_seeded() -> None:
    def run(seed: int) -> int:
        link = Link(LinkParams(rate_bps=0, delay_s=0, loss=0.1), 1500, 0, random.Random(seed))
        for i in range(10000):
            link.offer(i * 1e-3, 100)
        return link.stats.dropped_loss

    a, b = run(1), run(1)
    assert a == b
    assert 800 < a < 1200


def test_jitter_without_reorder_keeps_order() -> None:
    link = Link(LinkParams(rate_bps=0, delay_s=0.01, jitter_s=0.02), 1500, 0.02, random.Random(5))
    for i in range(200):
        assert link.push(i * 1e-4, i.to_bytes(2, "big"))
    out = link.pop_due(10.0)
    assert [int.from_bytes(p, "big") for p in out] == list(range(200))


def test_jitter_with_reorder_reorders_and_delivers_all() -> None:
    link = Link(
        LinkParams(rate_bps=0, delay_s=0.01, jitter_s=0.02, reorder=True),
        1500,
        0.02,
        random.Random(5),
    )
    for i in range(200):
        link.push(i * 1e-4, i.to_bytes(2, "big"))
    got: list[int] = []
    t = 0.0
    while link.held():
        due = link.next_due()
        assert due is not None and due >= t
        t = due
        got.extend(int.from_bytes(p, "big") for p in link.pop_due(t))
    assert sorted(got) == list(range(200))
    assert got != list(range(200))


def test_pop_due_respects_delay() -> None:
    link = Link(LinkParams(rate_bps=0, delay_s=0.05), 1500, 0.1)
    link.push(1.0, b"x")
    assert link.pop_due(1.049) == []
    assert link.next_due() == pytest.approx(1.05)
    assert link.pop_due(1.05) == [b"x"]
    assert link.next_due() is None


def test_update_changes_rate_keeps_held_packets() -> None:
    link = Link(LinkParams(rate_bps=8e6, delay_s=0.1, reorder=True, jitter_s=0.01), 1500, 0.2)
    for i in range(10):
        link.push(0.0, bytes([i]))
    link.update(LinkParams(rate_bps=8e3, delay_s=0.0))
    assert link.held() == 10
    out = link.pop_due(100.0)
    assert len(out) == 10
    due = link.offer(200.0, 1000)  # 1000 bytes at 8 kbit/s: one second
    assert due == pytest.approx(201.0)


def test_split_commands() -> None:
    assert split_commands(["--", "a", "1", ":::", "b", "2"]) == (["a", "1"], ["b", "2"])
    assert split_commands(["a"]) == (["a"], [])
