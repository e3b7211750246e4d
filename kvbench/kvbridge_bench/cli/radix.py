"""WAN bytes with and without the decode-side radix cache on an agent trace,
the main decode's hit rate against the prefill side's, and the router's
decisions; plus the radix lookup cost against hashing alone."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvbridge.cache import RadixCache
from kvbridge.cache.hashing import page_hashes
from kvbridge.layout import KVLayout
from kvbridge.router import RouterConfig

from ..sim.prefix_bench import run_prefix_bench
from ..sim.trace import AgentTraceConfig, generate_agent_trace, hit_stats
from ..sim.trace_format import load_jsonl
from .output import emit_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, default=None, help="sessions to generate")
    p.add_argument("--demo", action="store_true", help="the scaled-down demo trace")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument(
        "--md-pages",
        default="none,32768,8192",
        help="comma-separated main-decode memory sizes in pages ('none': unbounded)",
    )
    p.add_argument("--wan-gbps", type=float, default=10.0, help="true WAN bandwidth")
    p.add_argument("--ttft-target", type=float, default=2.0, help="seconds")
    p.add_argument("--anomalous-filter", action="store_true")
    p.add_argument(
        "--json", help="write every figure to this JSON file (-: to stdout, the tables to stderr)"
    )
    p.add_argument("--skip-lookup-bench", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.trace:
        trace = load_jsonl(args.trace)
    else:
        cfg = (
            AgentTraceConfig.demo(seed=args.seed) if args.demo else AgentTraceConfig(seed=args.seed)
        )
        if args.sessions is not None:
            cfg = cfg.scaled(num_sessions=args.sessions)
        trace = generate_agent_trace(cfg)
    st = hit_stats(trace)
    print(
        f"trace {trace.name or '?'}: {st.requests} requests, {trace.total_tokens} prompt tokens, "
        f"longest {st.max_tokens}; ideal hit mean {st.mean_hit:.3f}, "
        f"{st.frac_above_95:.1%} of requests > 95%, {st.frac_below_50:.1%} < 50%"
    )
    layout = KVLayout.for_model(args.model)
    rcfg = RouterConfig(ttft_target_s=args.ttft_target, anomalous_filter=args.anomalous_filter)
    out: dict[str, object] = {"trace": st.as_dict(), "runs": []}
    runs: list[dict[str, object]] = []
    for item in args.md_pages.split(","):
        pages = None if item.strip().lower() == "none" else int(item)
        rep = run_prefix_bench(
            trace,
            layout,
            page_tokens=args.page_tokens,
            md_pages=pages,
            wan_bps=args.wan_gbps * 1.25e8,
            router_config=rcfg,
            keep_records=False,
        )
        print()
        print(rep.format())
        runs.append(rep.as_dict())
    out["runs"] = runs
    if not args.skip_lookup_bench:
        out["lookup"] = _lookup_bench(args.page_tokens)
    if args.json == "-":
        emit_json(out, indent=2)
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def _lookup_bench(page_tokens: int, n_tokens: int = 65536, reps: int = 7) -> dict[str, float]:
    """Radix lookup of a fully cached 64K-token prompt vs hashing it alone."""
    toks = np.random.default_rng(0).integers(0, 128256, n_tokens).astype(np.int32)
    cache = RadixCache(page_tokens)
    cache.insert(toks, list(range(n_tokens // page_tokens)))

    def median(fn: object) -> float:
        times = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            if i >= 2:  # two warm-up rounds
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    base = median(lambda: page_hashes(toks, page_tokens))
    look = median(lambda: cache.lookup(toks))
    print(
        f"\nlookup of a cached {n_tokens}-token prompt: {look * 1e3:.2f} ms, "
        f"{look / base:.2f}x the time of hashing it alone ({base * 1e3:.2f} ms)"
    )
    return {"lookup_s": look, "hash_only_s": base, "ratio": look / base}
