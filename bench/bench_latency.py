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

from kvbridge.cli import latency


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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=latency.__doc__)
    latency.add_arguments(parser)
    sys.exit(latency.run(parser.parse_args()))
