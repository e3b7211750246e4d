"""How fast the fleet simulator runs: one simulated hour of a 100-engine
fleet (the paper's parameter file: 50 prefills and 5 relays of chip A, 45
main decodes of chip B) under the agent workload, through the full PDD
pipeline.  Prints the wall and CPU seconds, the requests and events; the
target (docs/plan.md) is under a minute on a 2-core x86 VM.

    .venv/bin/python bench/plan_speed.py [--rate 12] [--hours 1]
"""

from __future__ import annotations

import argparse
import os
import time

from kvbridge_bench.plan.paper import Fleet, paper_mix, paper_spec
from kvbridge_bench.plan.params import load_params
from kvbridge_bench.plan.sim import Simulation
from kvbridge_bench.plan.workload import agent_requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", type=float, default=12.0, help="requests/s")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--fleet", default="50,5,45")
    args = ap.parse_args()
    p = load_params("paper")
    pr, rl, md = (int(x) for x in args.fleet.split(","))
    fleet = Fleet(pr, rl, md)
    spec = paper_spec(p, fleet)
    dur = args.hours * 3600
    w0, c0 = time.perf_counter(), time.process_time()
    reqs = agent_requests(paper_mix(p), args.rate, dur, {spec.md_page_tokens})
    w1, c1 = time.perf_counter(), time.process_time()
    out = Simulation(spec, "pdd", reqs, open_loop=True, horizon_s=dur + 120).run()
    w2, c2 = time.perf_counter(), time.process_time()
    done = sum(1 for r in out.requests if r.t_done == r.t_done)
    print(
        f"{fleet.prefills + fleet.relays + fleet.mains} engines, {dur:.0f} simulated s, "
        f"{len(reqs)} requests ({done} done), {out.events} events; load average at start "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(f"workload (tokens, hashes): {w1 - w0:.1f} s wall, {c1 - c0:.1f} s CPU")
    print(f"simulation: {w2 - w1:.1f} s wall, {c2 - c1:.1f} s CPU")
    print(f"total: {w2 - w0:.1f} s wall, {c2 - c0:.1f} s CPU")


if __name__ == "__main__":
    main()
