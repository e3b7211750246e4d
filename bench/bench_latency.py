"""Small-transfer latency of kvbridge's UCX and TCP paths against NIXL and a
raw uvloop ping-pong.

``python bench/bench_latency.py [options]`` (or ``kvbridge-bench latency``)
runs the full comparison.  Under pytest, a short version checks that every
row produces samples.
"""

from __future__ import annotations

import argparse
import sys

import pytest

from kvbridge.errors import KVBridgeError
from kvbridge_bench.cli import latency


@pytest.mark.ucx
def test_latency_small() -> None:
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(ucx.unavailable_reason())
    cfgs = latency.configs(["tcp", "tcp,sm"], ["uvloop", "kvb-tcp", "kvb-ucx"], 200)
    latency.measure(cfgs, 4096, warmup=5, rounds=2, burst=10, timeout=60.0)
    print("\n" + latency.format_rows(cfgs, 4096, "idle"))
    for c in cfgs:
        assert not c.error, (c.name, c.error)
        assert len(c.samples) == 20, c.name
        assert [len(b) for b in c.bursts] == [10, 10], c.name
    assert latency.format_positions(cfgs, 4096, "idle").count(" 1:") == len(cfgs)


def test_positions() -> None:
    """--positions: each row's median over its bursts at chosen positions
    (1-5, every fifth, the last), in microseconds; a row without full
    bursts (an error) is left out."""
    a = latency.Config("a", "kvb-ucx", {}, {}, "")
    a.bursts = [[10e-6 * (i + 1) + 1e-6 * r for i in range(30)] for r in range(3)]
    b = latency.Config("b", "nixl", {}, {}, "", error="failed")
    out = latency.format_positions([a, b], 4096, "idle").splitlines()
    assert out[0].startswith("# median by position in the burst") and "3 bursts" in out[0]
    assert len(out) == 2 and " b " not in out[1]
    cells = dict(c.split(":") for c in out[1].split()[3:])
    assert list(cells) == ["1", "2", "3", "4", "5", "10", "15", "20", "25", "30"]
    assert cells["1"] == "11.0" and cells["10"] == "101.0" and cells["30"] == "301.0"


def test_placement() -> None:
    """pinned: side 0 of a pair on one CPU, side 1 on another (its threads
    too); shared: both on one; os: the kernel's; anything else refused."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    assert latency.side_cpus("os") is None
    assert latency.side_cpus("shared") == (cpus[0], cpus[0])
    with pytest.raises(KVBridgeError, match="placement"):
        latency.side_cpus("spread")
    if len(cpus) < 2:
        assert latency.side_cpus("pinned") is None
        return
    assert latency.side_cpus("pinned") == (cpus[0], cpus[1])
    cfg = latency.configs(["tcp"], ["uvloop"], 1000)[0]
    pair = latency.Pair(cfg, 4096, 4, latency.side_cpus("pinned"))
    try:
        pair.start(60.0)
        for role, p in enumerate(pair.procs):
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {cpus[role]}, (role, tid)
        samples, _ = pair.burst(3, 60.0)
        assert len(samples) == 3
    finally:
        pair.close()


def test_latency_rows() -> None:
    """Every busy_poll_us x poll_yield_us pair gets an awaiting row, every
    poll_yield_us a polling row; the first values are the unmarked defaults."""
    cfgs = latency.configs(["tcp"], ["kvb-ucx", "kvb-ucx-poll"], [1000, 200], [0, 20])
    names = [c.name for c in cfgs]
    assert names == [
        "kvbridge UCX tcp",
        "kvbridge UCX tcp y=20",
        "kvbridge UCX tcp bp=200",
        "kvbridge UCX tcp bp=200 y=20",
        "kvbridge UCX tcp poll",
        "kvbridge UCX tcp poll y=20",
    ]
    assert cfgs[3].opts == {"busy_poll_us": 200, "poll_yield_us": 20}
    assert cfgs[5].opts == {"busy_poll_us": 1000, "poll_yield_us": 20, "mode": "poll"}


def test_baseline_and_nixl_rows() -> None:
    """A baseline tree adds UCX await and poll rows run by that tree; nixl-req adds
    NIXL driven with one handle per request (as vLLM's connector); kvb-ucx-prep a
    prepared send posted per request (beside NIXL's re-posted handle)."""
    libs = ["kvb-ucx", "kvb-ucx-poll", "kvb-ucx-prep", "nixl", "nixl-req"]
    cfgs = latency.configs(["tcp"], libs, 1000, baseline="/b")
    by = {c.name: c for c in cfgs}
    assert list(by) == [
        "kvbridge UCX tcp",
        "kvbridge UCX tcp poll",
        "kvbridge UCX tcp prepared",
        "kvbridge UCX tcp baseline",
        "kvbridge UCX tcp poll baseline",
        "NIXL tcp",
        "NIXL tcp per request",
    ]
    assert by["kvbridge UCX tcp baseline"].opts["tree"] == "/b"
    assert "mode" not in by["kvbridge UCX tcp baseline"].opts
    assert by["kvbridge UCX tcp poll baseline"].opts["tree"] == "/b"
    assert by["kvbridge UCX tcp prepared"].opts["prepared"] is True
    assert by["kvbridge UCX tcp prepared"].opts["mode"] == "poll"
    assert by["NIXL tcp per request"].opts["per_request"] is True
    assert "per_request" not in by["NIXL tcp"].opts


@pytest.mark.ucx
def test_nixl_per_request_row() -> None:
    """NIXL's per-request handles (make_prepped_xfer, the request id as the
    notification) ping-pong to completion, each side matching the id."""
    pytest.importorskip("nixl")
    cfgs = latency.configs(["tcp,sm"], ["nixl-req"], 1000)
    latency.measure(cfgs, 4096, warmup=5, rounds=2, burst=10, timeout=60.0)
    assert not cfgs[0].error, cfgs[0].error
    assert len(cfgs[0].samples) == 20


@pytest.mark.ucx
def test_prepared_send_row() -> None:
    """The prepared-send row ping-pongs to completion (each post its own request id)."""
    cfgs = latency.configs(["tcp,sm"], ["kvb-ucx-prep"], 1000)
    latency.measure(cfgs, 4096, warmup=5, rounds=2, burst=10, timeout=60.0)
    assert not cfgs[0].error, cfgs[0].error
    assert len(cfgs[0].samples) == 20


@pytest.mark.ucx
def test_engine_call_rows() -> None:
    """kvb-ucx-engine: the prepared row with the engine's calls on the post,
    the wait, or both (three rows, each ratio'd against NIXL over its
    UCX_TLS); each ping-pongs to completion, and its side checks that its
    landing page holds the other side's bytes after every burst."""
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(ucx.unavailable_reason())
    cfgs = latency.configs(["tcp,sm"], ["kvb-ucx-engine"], 1000)
    assert [(c.name, c.opts["engine_post"], c.opts["engine_wait"]) for c in cfgs] == [
        ("kvbridge UCX tcp,sm engine calls", True, True),
        ("kvbridge UCX tcp,sm engine post", True, False),
        ("kvbridge UCX tcp,sm engine wait", False, True),
    ]
    latency.measure(cfgs, 4096, warmup=5, rounds=2, burst=10, timeout=60.0)
    for c in cfgs:
        assert not c.error, (c.name, c.error)
        assert len(c.samples) == 20 and all(x > 0 for x in c.samples), c.name


def test_trace_steps() -> None:
    """Each leg's steps from both sides' stamps (seconds); a leg whose
    expect resolved before the other side's send() was called is refused."""
    a = [(1.0, 1.000010, 1.000050, 1.000052)]
    b = [(1.000008, 1.000012, 1.000030)]
    steps, half = latency.trace_steps(a, b)
    us = [round(x, 3) for _, x in steps]
    assert us == [10.0, -2.0, 4.0, 18.0, 20.0, 2.0]
    assert round(sum(us), 3) == round(2 * half, 3) == 52.0
    with pytest.raises(KVBridgeError, match="out of order"):
        latency.trace_steps(a, [(0.999, 1.000012, 1.000030)])  # landed before it was sent
    with pytest.raises(KVBridgeError, match="out of order"):
        latency.trace_steps([(1.0, 1.000010, 1.000011, 1.000052)], b)  # before B's send()


@pytest.mark.ucx
@pytest.mark.parametrize("mode", ["await", "poll"])
def test_ucx_trace_two_processes(mode: str) -> None:
    """The two-process timeline of --breakdown: six steps per leg, stamped on
    the clock both processes share, in causal order (ucx_trace raises
    otherwise)."""
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(ucx.unavailable_reason())
    steps, half = latency.ucx_trace("tcp,sm", 4096, 40, mode, {}, 60.0)
    assert [name for name, _ in steps] == list(latency.UCX_TRACE_STEPS)
    assert half > 0
    assert all(us == us for _, us in steps)  # no NaN
    # the legs' medians: the two loop hops and the two send() calls are real time
    assert steps[0][1] > 0 and steps[3][1] > 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=latency.__doc__)
    latency.add_arguments(parser)
    sys.exit(latency.run(parser.parse_args()))
