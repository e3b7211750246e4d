"""TCP loopback goodput of two kvbridge source trees side by side, in one run.

    git worktree add --detach /tmp/kvb-base-tx 6ab7838        # the tree before
    (cd /tmp/kvb-base-tx && make inplace PY=/path/to/.venv/bin/python)
    make inplace PY=$PWD/.venv/bin/python                       # the tree under test
    python bench/transfer_vs_commit.py --base /tmp/kvb-base-tx --new .

Each tree needs ``kvbridge/_core*.so`` built in place for the interpreter that
runs this script.  A round runs, for each tree in turn (the order flips every
round), a subprocess (``python -S`` with the tree first on the path, so an
editable install does not shadow it) that starts that tree's own
``kvbridge-bench transfer serve`` in a second process and measures that
tree's ``measure_goodput`` against it: kvbridge TCP and raw uvloop sockets
moving the same random bytes over the same number of streams, interleaved
transfer by transfer.  The table prints new / base of kvbridge's goodput and
of its ratio to the raw sockets of the same subprocess (which cancels most of
what the machine does meanwhile), medians over rounds and their spread.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import site
import statistics
import subprocess
import sys
from typing import Any


def _bench_module() -> Any:
    """The transfer bench of the tree on PYTHONPATH: kvbridge_bench's (under
    kvbench/, since the library and the bench were split), kvbridge_bench.cli's
    (before), kvbridge/transport/benchmark.py (before the reshape)."""
    import kvbridge

    tree = os.path.dirname(os.path.dirname(os.path.abspath(kvbridge.__file__)))
    if os.path.isdir(os.path.join(tree, "kvbench", "kvbridge_bench")):
        from kvbridge_bench.cli import transfer_bench as bm
    elif os.path.isdir(os.path.join(tree, "kvbridge", "cli")):
        bm = importlib.import_module("kvbridge.cli.transfer_bench")
    else:
        bm = importlib.import_module("kvbridge.transport.benchmark")
    return bm


def _env(tree: str) -> dict[str, str]:
    env = dict(os.environ)
    tree = os.path.abspath(tree)
    paths = [tree, os.path.join(tree, "kvbench"), *site.getsitepackages()]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if os.path.isdir(p))
    return env


def serve() -> int:
    """The receiving end: this tree's bench server; prints its ports."""
    from kvbridge.transport.tcp import new_event_loop

    bm = _bench_module()
    loop = new_event_loop()

    def ready(info: dict[str, Any]) -> None:
        print(json.dumps(info), flush=True)

    try:
        loop.run_until_complete(bm.serve("127.0.0.1", 0, 0, ready=ready))
    except KeyboardInterrupt:
        pass
    return 0


def worker(mib: int, streams: int, repeats: int) -> dict[str, float]:
    from kvbridge.transport.tcp import new_event_loop

    bm = _bench_module()
    me = os.path.abspath(__file__)
    srv = subprocess.Popen(
        [sys.executable, "-S", me, "--serve"], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert srv.stdout is not None
        info = json.loads(srv.stdout.readline())
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        res = loop.run_until_complete(
            bm.measure_goodput(
                info["host"],
                info["port"],
                info["raw_port"],
                nbytes=mib << 20,
                streams=streams,
                repeats=repeats,
                warmup=1,
                compression="off",
            )
        )
        return {"GBps": res["kvbridge_GBps"], "raw_GBps": res["raw_GBps"]}
    finally:
        srv.terminate()
        srv.wait(30)


def run_tree(tree: str, mib: int, streams: int, repeats: int) -> dict[str, float]:
    cmd = [sys.executable, "-S", os.path.abspath(__file__), "--worker"]
    cmd += ["--mib", str(mib), "--streams", str(streams), "--repeats", str(repeats)]
    res = subprocess.run(cmd, env=_env(tree), capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        sys.stderr.write(res.stderr)
        raise SystemExit(f"{tree}: worker failed ({res.returncode})")
    out: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", help="the baseline tree")
    ap.add_argument("--new", help="the tree under test")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256, help="bytes per transfer (MiB)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed transfers per subprocess")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve()
    if args.worker:
        print(json.dumps(worker(args.mib, args.streams, args.repeats)))
        return 0
    if not args.base or not args.new:
        ap.error("--base and --new are required")
    goodput: list[float] = []
    vs_raw: list[float] = []
    for r in range(args.rounds):
        order = [("base", args.base), ("new", args.new)]
        if r % 2:
            order.reverse()
        got = {k: run_tree(t, args.mib, args.streams, args.repeats) for k, t in order}
        goodput.append(got["new"]["GBps"] / got["base"]["GBps"])
        vs_raw.append(
            (got["new"]["GBps"] / got["new"]["raw_GBps"])
            / (got["base"]["GBps"] / got["base"]["raw_GBps"])
        )
        print(
            f"round {r}: base {got['base']['GBps']:.2f} GB/s (raw {got['base']['raw_GBps']:.2f}), "
            f"new {got['new']['GBps']:.2f} GB/s (raw {got['new']['raw_GBps']:.2f})",
            file=sys.stderr,
        )
    print(
        f"TCP loopback, {args.mib} MiB x {args.repeats}, {args.streams} streams, {args.rounds} rounds"
    )
    for name, v in (("goodput new/base", goodput), ("(goodput / raw) new/base", vs_raw)):
        print(f"{name:<28}{statistics.median(v):>7.2f}  ({min(v):.2f}-{max(v):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
