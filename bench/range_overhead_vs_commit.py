"""The Python cost of checking one range, in two kvbridge source trees side
by side, in one run.

    python bench/range_overhead_vs_commit.py --base /tmp/kvb-base --new /tmp/kvb-new

Each tree needs ``kvbridge/_core*.so`` built in place for the interpreter
that runs this script (``make inplace``).  The trees run in alternating
subprocesses (``python -S`` with the tree first on the path, so an editable
install does not shadow it; the order flips every round).  Each subprocess
times, per call, ``pack(cache, table, 0, 1, out=...)`` (one token: the bytes
moved are negligible, what is left is the argument checks) and
``KVRange(cache, table, 0, 1)`` on Llama-3-8B bf16, after a warm-up; the
table prints the medians over rounds in microseconds and new / base (below 1:
the new tree checks faster).
"""

from __future__ import annotations

import argparse
import os
import site
import statistics
import subprocess
import sys

CODE = r"""
import sys, time
import numpy as np
from kvbridge.layout import KVLayout
from kvbridge.pack import KVRange, PagedKVCache, pack

lay = KVLayout.for_model("llama-3-8b", dtype="bf16", page_tokens=16)
cache = PagedKVCache.allocate(lay, 4)
out = np.empty(lay.wire_nbytes(1), np.uint8)
table = np.arange(4, dtype=np.int32)
n = int(sys.argv[1])


def per_call(fn):
    for _ in range(n // 10):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


print(per_call(lambda: pack(cache, table, 0, 1, out=out)),
      per_call(lambda: KVRange(cache, table, 0, 1)))
"""

WHAT = ["pack(cache, table, 0, 1)", "KVRange(cache, table, 0, 1)"]


def _run(tree: str, calls: int) -> list[float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), *site.getsitepackages()])
    out = subprocess.run(
        [sys.executable, "-S", "-c", CODE, str(calls)],
        env=env,
        cwd=tree,  # "-c" puts the working directory first on the path: the tree's
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [float(x) for x in out.split()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the baseline tree")
    ap.add_argument("--new", required=True, help="the tree under test")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20000, help="timed calls per subprocess")
    args = ap.parse_args()
    got: dict[str, list[list[float]]] = {"base": [], "new": []}
    for r in range(args.rounds):
        order = [("base", args.base), ("new", args.new)]
        for name, tree in order if r % 2 == 0 else order[::-1]:
            got[name].append(_run(tree, args.calls))
    print(f"{'call':32} {'base us':>8} {'new us':>8} {'new/base':>9}  (min-max of new/base)")
    for i, what in enumerate(WHAT):
        b = [x[i] for x in got["base"]]
        n = [x[i] for x in got["new"]]
        ratios = [y / x for x, y in zip(b, n, strict=True)]
        print(
            f"{what:32} {statistics.median(b):8.2f} {statistics.median(n):8.2f} "
            f"{statistics.median(n) / statistics.median(b):9.2f}  "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
        )
    print(f"{args.rounds} rounds, alternating order; {args.calls} calls per subprocess")
    return 0


if __name__ == "__main__":
    sys.exit(main())
