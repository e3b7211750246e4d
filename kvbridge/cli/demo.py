"""The full cross-datacenter PDD demo: prefill, relay decode and main decode
as separate processes with the reference decoder, the main decode behind the
WAN emulator; an agent trace replayed once per pipeline (baseline, + radix
cache, + relay and token-ID handoff).  Prints a table per pipeline, writes a
PNG of the TTFT CDFs and a JSON file of every figure."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..demo.config import DemoConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="reference: kvbridge's reference decoder; vllm: vLLM engines with SmolLM2 "
        "(kvbridge.cli.vllm_demo, make demo-vllm)",
    )
    p.add_argument("--smoke", action="store_true", help="reduced run (CI): few short requests")
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="where the PNG and JSON go")
    p.add_argument("--wan", choices=["auto", "netns", "proxy"], default="auto")
    p.add_argument("--rate", type=float, help="WAN line rate in Mbit/s")
    p.add_argument("--rtt", type=float, help="WAN round trip in ms")
    p.add_argument("--requests", type=int, help="replay at most this many requests")
    p.add_argument("--relay-transport", choices=["ucx", "tcp"], help="prefill -> relay path")
    p.add_argument("--pipelines", help="comma-separated subset of baseline,radix,pdd")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the figures as JSON at the end")


def config_from(args: argparse.Namespace) -> DemoConfig:
    cfg = DemoConfig.smoke() if args.smoke else DemoConfig()
    changes: dict[str, object] = {"wan_mode": args.wan}
    if args.rate:
        changes["wan_rate_bps"] = args.rate * 1e6
    if args.rtt:
        changes["wan_rtt_ms"] = args.rtt
    if args.requests:
        changes["max_requests"] = args.requests
    if args.relay_transport:
        changes["rld_transport"] = args.relay_transport
    elif not _ucx_ok():
        print("UCX unavailable here: the prefill -> relay path uses local TCP", file=sys.stderr)
        changes["rld_transport"] = "tcp"
    if args.pipelines:
        changes["pipelines"] = [x.strip() for x in args.pipelines.split(",") if x.strip()]
    return cfg.replace(**changes)


def _ucx_ok() -> bool:
    try:
        from ..transport import ucx

        return bool(ucx.available())
    except ImportError:
        return False


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from .vllm_demo import run as run_vllm

        return run_vllm(args)
    from ..demo.driver import run_demo
    from ..transport.tcp import run as run_loop

    cfg = config_from(args)
    result = run_loop(run_demo(cfg, args.out, progress=not args.no_progress))
    ratios = result.ratios()
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    for kind, path in result.paths.items():
        print(f"wrote {kind}: {path}")
    if args.json:
        print(json.dumps({"ratios": ratios, "summaries": [s.as_dict() for s in result.summaries]}))
    if not result.ok:
        print("FAILED: some requests did not complete or their streams were not exact")
        return 1
    print("every request completed; every stream is exact")
    return 0
