"""The fleet demo on etcd (``make demo-fleet``): the reference engine as 2
prefills, 1 relay decode and 2 main decodes, each registered in a real etcd
under a lease; the driver routes with kvbridge's FleetRouter fed by an etcd
watch and replays agent sessions; halfway through one main decode is killed
(its lease expires, its requests are re-routed) and later a new one joins.
Every stream is checked against the reference engine's output."""

from __future__ import annotations

import argparse
import asyncio
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--smoke", action="store_true", help="reduced run (CI): random model, few requests"
    )
    p.add_argument("--sessions", type=int, help="agent sessions (default 6)")
    p.add_argument("--ttl", type=int, default=5, help="registration lease in seconds")


def run(args: argparse.Namespace) -> int:
    from ..demo.fleet import fleet_config, run_fleet_demo

    cfg = fleet_config(args.smoke)
    if args.sessions:
        cfg = cfg.replace(sessions=args.sessions)
    try:
        res = asyncio.run(run_fleet_demo(cfg, ttl_s=args.ttl))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("fleet demo interrupted: its processes are stopped", file=sys.stderr)
        return 130
    if not res.ok:
        print("FAILED: some requests did not complete or their streams were wrong")
        return 1
    print("every request completed; every stream equals the reference (exact or a near tie)")
    return 0
