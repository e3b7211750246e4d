"""TCP transfer benchmarks between two local processes (results in
``extra_info``; ratios against raw uvloop sockets measured in the same run).

    make bench                                   (full sizes: KVB_BENCH_MIB=256, KVB_BIG_MIB=2048)
    pytest bench/bench_transfer.py --benchmark-disable     (a quick smoke run)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.cli import transfer_bench as bm
from kvbridge.transport.tcp import run

MiB = 1 << 20
SMALL = os.environ.get("KVB_BENCH_QUICK", "1") == "1"


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, Any]]:
    proc, info = bm.spawn_server()
    try:
        yield info
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize("streams", [1, 4])
def test_goodput_vs_raw_uvloop(benchmark: Any, server: dict[str, Any], streams: int) -> None:
    mib = int(os.environ.get("KVB_BENCH_MIB", "32" if SMALL else "256"))

    def measure() -> dict[str, Any]:
        return run(
            bm.measure_goodput(
                server["host"], server["port"], server["raw_port"],
                nbytes=mib * MiB, streams=streams, repeats=2 if SMALL else 5,
            )
        )  # fmt: skip

    res = benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    print(f"\ngoodput {streams} streams: ratio {res['ratio']:.2f}x of raw uvloop", res)
    assert res["kvbridge_GBps"] > 0 and res["raw_GBps"] > 0


@pytest.mark.parametrize("scheduler", ["srpt", "fifo"])
def test_small_transfer_latency_behind_large(
    benchmark: Any, server: dict[str, Any], scheduler: str
) -> None:
    big = int(os.environ.get("KVB_BIG_MIB", "256" if SMALL else "2048"))

    def measure() -> dict[str, Any]:
        return run(
            bm.measure_latency(
                server["host"], server["port"], big_bytes=big * MiB,
                count=10 if SMALL else 50, scheduler=scheduler,
            )
        )  # fmt: skip

    res = benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    print(f"\nlatency {scheduler}:", res)
    assert res["samples"] >= 1
