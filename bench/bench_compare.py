"""kvbridge's UCX path against NIXL, Mooncake and a raw ucxx send.

``python bench/bench_compare.py [options]`` (or ``kvbridge-bench compare``)
runs the full comparison (4096 pages of 64 KiB and a Llama-3-8B 32K-token
request, over UCX_TLS=tcp and tcp,sm) and prints GB/s, per-request latency and
the ratio to raw ucxx.  Under pytest, a small version checks that the
comparison runs and that kvbridge's pages arrive intact.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pytest

from kvbridge_bench.cli import compare


def _small_args(libs: str) -> Any:
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    return p.parse_args(
        [
            "--libs",
            libs,
            "--scenarios",
            "bulk,pages",
            "--bulk-mib",
            "8",
            "--pages",
            "256",
            "--iters",
            "2",
            "--timeout",
            "120",
        ]
    )


@pytest.mark.ucx
def test_compare_small(benchmark: Any) -> None:
    missing = compare.missing_libraries(["kvbridge", "ucxx"])
    if missing:
        pytest.skip(f"not installed: {missing}")
    args = _small_args("kvbridge,ucxx")

    def once() -> list[dict[str, Any]]:
        return compare.compare(
            [
                x
                for x in ("kvbridge", "ucxx", "perftest")
                if x not in compare.missing_libraries([x])
            ],
            compare.scenarios(args),
            ["tcp", "shm"],
            args.iters,
            args.timeout,
            verbose=False,
            put_windows=(0,),
            poll_yields=(20,),
        )

    rows = benchmark.pedantic(once, rounds=1, iterations=1)
    print("\n" + compare.format_table(rows))
    for r in rows:
        assert "error" not in r, r
        assert r["ok"], r
    assert {r["row"] for r in rows} >= {
        "kvbridge",
        "kvbridge peer",
        "kvbridge window=0",
        "kvbridge yield=20",
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=compare.__doc__)
    compare.add_arguments(parser)
    sys.exit(compare.run(parser.parse_args()))
