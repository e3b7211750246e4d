"""Where the engine thread's time in ``SyncBridge.expect`` and ``send`` goes:
each call and its parts (the span's copy of the block table, the ticket's
decode) timed back to back (warm: the same code a thousand times in a row)
and once per engine step (cold: after the step's 1.8 ms sleep, while the
previous request's KV moves on kvbridge's threads), beside a pure-Python
control of about the same warm cost.  Two SyncBridges in this process over
TCP, SmolLM2-135M's KV shape, 256-token requests.

  python bench/sync_call_costs.py [--steps 300]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.bridge.ticket import Ticket
from kvbridge.span import KVSpan
from kvbridge_bench.cli import embedded_peers as ep


def _p50(xs: list[int]) -> float:
    return sorted(xs)[len(xs) // 2] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    pre, md, _, _ = ep.make_pair("tcp", 600, 600)
    n = 256
    pages = np.arange(ep.SMOL.pages_for(n))
    control = ep.calibrate_control(20.0)
    parts: dict[str, Callable[[int, Any], Any]] = {
        "control (20 us of Python, warm)": lambda i, tk: control(),
        "KVSpan(block_table) (the table's copy)": lambda i, tk: KVSpan(pages, 0, 0),
        "Ticket.decode": lambda i, tk: Ticket.decode(tk),
    }
    warm: dict[str, list[int]] = {}
    cold: dict[str, list[int]] = {}
    try:
        tk0 = md.expect("warm", pages, 0, n)
        for name, fn in parts.items():  # back to back
            for _ in range(1000):
                t0 = time.perf_counter_ns()
                fn(0, tk0)
                warm.setdefault(name, []).append(time.perf_counter_ns() - t0)
        for i in range(args.steps):  # expect + send back to back (no transfer runs)
            t0 = time.perf_counter_ns()
            tk = md.expect(f"w{i}", pages, 0, n)
            t1 = time.perf_counter_ns()
            pre.send(f"w{i}", pages, {"d": tk})
            t2 = time.perf_counter_ns()
            pre.cancel(f"w{i}")
            warm.setdefault("SyncBridge.expect", []).append(t1 - t0)
            warm.setdefault("SyncBridge.send", []).append(t2 - t1)
        time.sleep(0.5)
        pre.poll()
        md.poll()
        for i in range(args.steps):  # once per step, a transfer running
            time.sleep(0.0018)
            for name, fn in parts.items():
                t0 = time.perf_counter_ns()
                fn(i, tk0)
                cold.setdefault(name, []).append(time.perf_counter_ns() - t0)
            t0 = time.perf_counter_ns()
            tk = md.expect(f"c{i}", pages, 0, n)
            t1 = time.perf_counter_ns()
            pre.send(f"c{i}", pages, {"d": tk})
            t2 = time.perf_counter_ns()
            cold.setdefault("SyncBridge.expect", []).append(t1 - t0)
            cold.setdefault("SyncBridge.send", []).append(t2 - t1)
            pre.poll()
            md.poll()
    finally:
        pre.close()
        md.close()
    print("| what | p50 back to back (us) | p50 once per step (us) |")
    print("|---|---|---|")
    for name in warm:
        print(f"| {name} | {_p50(warm[name]):.1f} | {_p50(cold[name]):.1f} |")


if __name__ == "__main__":
    main()
