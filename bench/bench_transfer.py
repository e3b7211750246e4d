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

from kvbridge.transport.tcp import run
from kvbridge_bench.cli import transfer_bench as bm

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


def test_small_transfer_latency_behind_large(benchmark: Any, server: dict[str, Any]) -> None:
    """Both policies in interleaved rounds, each with its full sample count
    (a large transfer that ends is replaced by the next)."""
    big = int(os.environ.get("KVB_BIG_MIB", "64" if SMALL else "2048"))
    count = 10 if SMALL else 50

    def measure() -> dict[str, Any]:
        return run(
            bm.measure_latency(
                server["host"], server["port"], big_bytes=big * MiB,
                count=count, rounds=2 if SMALL else 5,
            )
        )  # fmt: skip

    res = benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    print("\nlatency:", res)
    assert [p["samples"] for p in res["policies"]] == [count, count]
    assert "fifo_over_srpt_p50" in res


@pytest.mark.parametrize("scenario", ["bulk", "pages"])
def test_tcp_rows_move_the_anchors_workload_intact(scenario: str) -> None:
    """kvbridge TCP (and Mooncake, where installed) move the scenario's
    bytes with a matching hash at both ends; raw uvloop moves them too."""
    import types

    from kvbridge_bench.cli import compare_peers
    from kvbridge_bench.cli import transfer_peers as tp
    from kvbridge_bench.cli.compare import scenarios

    (scen,) = scenarios(
        types.SimpleNamespace(
            scenarios=scenario, bulk_mib=8, pages=128, page_kib=64, llama_tokens=0,
            block_tables="shuffled",
        )
    )  # fmt: skip
    libs = ["kvbridge", "kvbridge-2pass", "raw"]
    if compare_peers.mooncake_unusable() is None:
        libs.append("mooncake")
    for row in tp.rows_for(libs, streams=2):
        r = tp.run_one(row, scen, iters=2, timeout=120.0)
        assert "error" not in r, (row.name, r.get("error"))
        assert len(r["times"]) == 2
        assert r["ok"] is (None if row.lib == "raw" else True), row.name


def test_the_exit_code_fails_only_rows_that_moved_wrong_bytes_or_failed() -> None:
    from kvbridge_bench.cli.transfer import exit_code

    assert exit_code([{"ok": True}, {"ok": None}]) == 0  # raw rows are not checked
    assert exit_code([{"ok": True}, {"ok": False}]) == 1
    assert exit_code([{"ok": True}, {"error": "no samples"}]) == 1
