"""Hit rates per 300 s of arrivals in one fleet simulation (docs/plan.md):
the prefills' own (prompt tokens their prefix cache held, of all prompt
tokens) and the main decodes' (tokens matched at negotiation), for the
requests prefilled in each window; with the fleet router's prefill queue
this is what shows a prefill losing its sessions.

    .venv/bin/python bench/plan_prefill_hit.py --fleet homogeneous   # the paper's 88 A, same DC, at the TTFT comparison's load
    .venv/bin/python bench/plan_prefill_hit.py --fleet pdd           # the paper's PDD fleet, same load
    .venv/bin/python bench/plan_prefill_hit.py --fleet 24,3,20 --rate 3
"""

from __future__ import annotations

import argparse
import math
import time

from kvbridge_bench.plan.paper import Fleet, paper_spec, run_fleet
from kvbridge_bench.plan.params import load_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fleet", default="homogeneous", help="homogeneous, pdd or P,RLD,MD (PDD)")
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: the paper's)")
    ap.add_argument("--duration", type=float, default=1800.0, help="simulated s")
    ap.add_argument("--window", type=float, default=300.0, help="s of arrivals per row")
    args = ap.parse_args()
    p = load_params("paper")
    pdd = Fleet(int(p["fleet.prefill_a"]), int(p["fleet.relay_a"]), int(p["fleet.main_b"]))
    hp = int(p["fleet.homogeneous_prefill"])
    if args.fleet == "homogeneous":
        fleet, pipeline = Fleet(hp, 0, int(p["fleet.homogeneous_a"]) - hp, same_dc=True), "same_dc"
    elif args.fleet == "pdd":
        fleet, pipeline = pdd, "pdd"
    else:
        pr, rl, md = (int(x) for x in args.fleet.split(","))
        fleet, pipeline = Fleet(pr, rl, md), "pdd"
    rate = args.rate
    if rate is None:  # the paper's TTFT comparison: the baseline at half the line's goodput
        spec = paper_spec(p, pdd)
        kv_prompt = int(p["workload.prompt_tokens"]) * spec.layout.bytes_per_token
        rate = 0.5 * spec.wan_rate * spec.wan_efficiency / kv_prompt
    t0 = time.process_time()
    res = run_fleet(p, fleet, pipeline, rate, args.duration, warmup_frac=0.4)
    print(
        f"{args.fleet} ({pipeline}), {rate:.2f} requests/s for {args.duration:.0f} simulated s; "
        f"measured TTFT p50 {res.q(50):.2f} s, p90 {res.q(90):.2f} s"
    )
    rs = res.outcome.requests
    lo = 0.0
    while lo < args.duration:
        w = [
            r for r in rs if lo <= r.arrival < lo + args.window and not math.isnan(r.t_prefill_end)
        ]
        n = max(1, sum(r.n for r in w))
        print(
            f"  arrivals {lo:5.0f}-{lo + args.window:5.0f} s: {len(w):5d} prefilled, "
            f"prefill hit {100 * sum(r.p_hit for r in w) / n:3.0f}%, "
            f"MD hit {100 * sum(r.matched for r in w) / n:3.0f}%"
        )
        lo += args.window
    print(f"{time.process_time() - t0:.0f} s CPU")


if __name__ == "__main__":
    main()
