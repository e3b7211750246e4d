"""Fleet simulator and capacity planner: kvbridge's own decision code (the
router and anomalous filter, the PDD core's relay budget and handoff, the
fleet router, the decode-side radix cache and prefix negotiation) driven by
simulated time over models of the engines and the links (docs/plan.md).

  kvbridge-bench plan --validate     the demo's scenario against its recorded run
  kvbridge-bench plan --paper        the paper's scenario, side by side with the paper
  kvbridge-bench plan [--trace F]    plan a deployment: TTFT CDFs, relay share, WAN
                                     utilisation, the cheapest engine counts within the SLA
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .output import emit_json

PAPER = {
    "ttft_pdd_vs_cross_dc": -0.515,
    "p90_ttft_pdd_vs_cross_dc": -0.46,
    "relay_share": 0.062,
    "relay_vs_main_load": 15.2,
    "drc_wan_saving": 10.0,
    "goodput_vs_cross_dc": 0.278,
    "benefit_cost_vs_homogeneous": 0.375,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--paper", action="store_true", help="the paper's scenario and its table")
    mode.add_argument(
        "--validate", action="store_true", help="the demo's scenario against its recorded run"
    )
    p.add_argument("--params", default=None, help="parameter file: demo, paper or a .toml path")
    p.add_argument("--trace", help="plan for this JSONL trace (kvbridge's trace format)")
    p.add_argument("--rate", type=float, default=None, help="requests/s of the agent generator")
    p.add_argument("--duration", type=float, default=None, help="simulated seconds of arrivals")
    p.add_argument("--high-share", type=float, default=None, help="share of turns hitting > 95%%")
    p.add_argument("--sla-ttft", type=float, default=None, help="TTFT SLA, seconds")
    p.add_argument("--sla-tpot", type=float, default=None, help="time per output token SLA, s")
    p.add_argument("--sla-quantile", type=float, default=None, help="share that must meet it")
    p.add_argument(
        "--no-search", action="store_true", help="simulate the --fleet only (no cheapest search)"
    )
    p.add_argument("--fleet", default=None, help="start fleet P,RLD,MD (planner: cut down from it)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a parameter of the file (e.g. wan.rate_bps=10e9); repeatable",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="shorter runs (a rough answer)")
    p.add_argument("--out", default="out/plan", help="folder for the PNG plots and JSON")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--json", action="store_true", help="the figures as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    if args.validate:
        return _validate(args)
    if args.paper:
        return _paper(args)
    return _planner(args)


# ---- validation ----------------------------------------------------------------------------
def recorded_demo() -> dict[str, Any]:
    from importlib import resources

    res = resources.files("kvbridge_bench.plan").joinpath("params").joinpath("demo_recorded.json")
    return dict(json.loads(res.read_text()))


def validation_rows(params: str = "demo", sets: list[str] | None = None) -> list[dict[str, Any]]:
    """Per pipeline and load point: the simulator's figures, the recorded
    demo's, and the relative error of each (times and relay share; the hit
    rates in points)."""
    from ..plan.demo_scenario import run_demo_scenario
    from ..plan.params import load_params, override

    rec = recorded_demo()["figures"]
    points = [(f["pipeline"], float(f["load"])) for f in rec]
    par = override(load_params(params), sets or [])
    sim = {(f.pipeline, f.load): f for f in run_demo_scenario(par, points=points)}
    rows = []
    for f in rec:
        s = sim[(f["pipeline"], float(f["load"]))]
        row: dict[str, Any] = {"pipeline": f["pipeline"], "load": f["load"]}
        for q in ("p50", "p90", "p99"):
            got, want = getattr(s, f"ttft_{q}") * 1e3, float(f[f"ttft_{q}"])
            row[f"ttft_{q}"] = {"sim": got, "demo": want, "err": got / want - 1}
        rs, want_rs = s.relay_share, float(f["relay_share"])
        row["relay_share"] = {
            "sim": rs,
            "demo": want_rs,
            "err": (rs / want_rs - 1) if want_rs else rs,
        }
        for k in ("md_hit", "p_hit"):
            got = getattr(s, k)
            row[k] = {"sim": got, "demo": float(f[k]), "err_points": (got - float(f[k])) * 100}
        rows.append(row)
    return rows


def _validate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    rows = validation_rows(args.params or "demo", args.set)
    secs = time.perf_counter() - t0
    if args.json:
        emit_json({"rows": rows, "recorded": recorded_demo(), "seconds": secs})
        return 0
    print(f"the demo's scenario in the simulator against the recorded run ({secs:.1f} s)")
    print(recorded_demo()["what"])
    hdr = (
        f"{'pipeline':9s} {'load':>4s} {'TTFT p50 sim/demo':>19s} {'err':>6s} "
        f"{'p90 sim/demo':>13s} {'err':>6s} {'p99 sim/demo':>13s} {'err':>6s} "
        f"{'relay % sim/demo':>16s} {'MD hit % sim/demo':>17s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        cells = []
        for q in ("p50", "p90", "p99"):
            c = r[f"ttft_{q}"]
            cells.append(f"{c['sim']:6.0f} / {c['demo']:6.0f} {c['err'] * 100:+5.0f}%")
        rs, mh = r["relay_share"], r["md_hit"]
        print(
            f"{r['pipeline']:9s} {r['load']:4.1f} {cells[0]:>27s} {cells[1]:>21s} {cells[2]:>21s} "
            f"{rs['sim'] * 100:7.1f} / {rs['demo'] * 100:4.1f} {mh['sim'] * 100:8.1f} / "
            f"{mh['demo'] * 100:4.1f}"
        )
    return 0


# ---- the paper's scenario --------------------------------------------------------------------
def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 100:+.1f}%"


def paper_figures(
    params: str = "paper", quick: bool = False, seed: int = 0, sets: list[str] | None = None
) -> dict[str, Any]:
    from ..plan.paper import Fleet, bathtub, capacity, goodput, paper_spec, run_fleet
    from ..plan.params import load_params, override

    p = override(load_params(params), sets or [])
    pdd = Fleet(int(p["fleet.prefill_a"]), int(p["fleet.relay_a"]), int(p["fleet.main_b"]))
    hp = int(p["fleet.homogeneous_prefill"])
    homog = Fleet(hp, 0, int(p["fleet.homogeneous_a"]) - hp, same_dc=True)
    spec = paper_spec(p, pdd)
    L = int(p["workload.prompt_tokens"])
    kv_prompt = L * spec.layout.bytes_per_token
    goodput_line = spec.wan_rate * spec.wan_efficiency
    # the load of the TTFT comparison: the unoptimised baseline's offered WAN
    # load at half the line's goodput (the demo's baseline ran at 0.40)
    rate = 0.5 * goodput_line / kv_prompt
    duration = 600.0 if quick else 1800.0
    t0 = time.perf_counter()
    runs = {
        name: run_fleet(p, fleet, pipe, rate, duration, seed=seed, warmup_frac=0.4)
        for name, fleet, pipe in (
            ("pdd", pdd, "pdd"),
            ("cross_dc", pdd, "baseline"),
            ("radix", pdd, "radix"),
            ("same_dc", homog, "same_dc"),
        )
    }
    a, b = runs["pdd"], runs["cross_dc"]
    sla = float(p["sla.ttft_s"])
    tpot = float(p["sla.tpot_s"])
    qt = float(p["sla.quantile"])
    gdur = 600.0 if quick else 1200.0

    def gp(fleet: Fleet, pipe: str, cap: float) -> tuple[float, list[tuple[float, float]]]:
        return goodput(
            lambda r: run_fleet(p, fleet, pipe, r, gdur, seed=seed, warmup_frac=0.4),
            sla,
            qt,
            lo=cap * 0.25,
            hi=cap * 1.25,
            steps=4 if quick else 6,
            tpot_s=tpot,
        )

    # each fleet's search brackets its saturation rate at the workload's mean hit
    mean_hit = runs["pdd"].md_hit()
    g_pdd, t_pdd = gp(pdd, "pdd", capacity(p, pdd, mean_hit))
    g_cross, t_cross = gp(pdd, "baseline", capacity(p, pdd, 0.0))
    g_homog, t_homog = gp(homog, "same_dc", capacity(p, homog, mean_hit))
    hits = [i / 100 for i in range(0, 100, 2)] + [0.99]
    tub = bathtub(p, hits, pdd, homog)
    sim_s = time.perf_counter() - t0
    relay_load = a.outcome.main_busy_s / max(a.outcome.relay_busy_s, 1e-9)
    relay_tokens = a.outcome.main_tokens / max(a.outcome.relay_tokens, 1)
    out = {
        "params": p.path,
        "rate": rate,
        "duration_s": duration,
        "fleet_pdd": pdd.chips(),
        "fleet_homogeneous": homog.chips(),
        "cost_pdd": pdd.cost(p),
        "cost_homogeneous": homog.cost(p),
        "ttft_mean": {k: r.mean() for k, r in runs.items()},
        "ttft_p50": {k: r.q(50) for k, r in runs.items()},
        "ttft_p90": {k: r.q(90) for k, r in runs.items()},
        "ttft_p99": {k: r.q(99) for k, r in runs.items()},
        "ttft_pdd_vs_cross_dc": a.mean() / b.mean() - 1,
        "p90_ttft_pdd_vs_cross_dc": a.q(90) / b.q(90) - 1,
        "relay_share": a.relay_share(),
        "relay_vs_main_load": relay_load,
        "relay_vs_main_tokens": relay_tokens,
        "md_hit": a.md_hit(),
        "drc_wan_saving": b.wan_bytes() / max(1, a.wan_bytes()),
        "wan_utilisation": {k: r.wan_utilisation(spec) for k, r in runs.items() if k != "same_dc"},
        "pipelines": {k: sorted({x.pipeline for x in r.measured}) for k, r in runs.items()},
        "p_rld_share": sum(1 for x in a.measured if x.pipeline == "P-RLD")
        / max(1, len(a.measured)),
        "relayed_share": sum(1 for x in a.measured if x.pipeline == "P-RLD-MD")
        / max(1, len(a.measured)),
        "goodput": {"pdd": g_pdd, "cross_dc": g_cross, "same_dc_homogeneous": g_homog},
        "goodput_tries": {"pdd": t_pdd, "cross_dc": t_cross, "same_dc_homogeneous": t_homog},
        "goodput_vs_cross_dc": (g_pdd / g_cross - 1) if g_cross > 0 else math.inf,
        "benefit_cost_vs_homogeneous": (g_pdd / pdd.cost(p)) / (g_homog / homog.cost(p)) - 1
        if g_homog > 0
        else math.inf,
        "sla_ttft_s": sla,
        "sla_tpot_s": tpot,
        "sla_quantile": qt,
        "tpot_p90": {k: r.tpot(90) for k, r in runs.items()},
        "bathtub": tub,
        "cdf": {k: sorted(r.ttfts()) for k, r in runs.items()},
        "requests": {k: len(r.measured) for k, r in runs.items()},
        "sim_seconds": sim_s,
        "parameters": [{"key": k, "value": v, "source": src} for k, v, src in p.rows()],
    }
    return out


def paper_table(f: dict[str, Any], demo: dict[str, Any] | None) -> str:
    d = demo or {}

    def dv(key: str) -> str:
        v = d.get(key)
        return "-" if v is None else v

    rows = [
        ("TTFT, PDD vs unoptimised cross-DC PD", _pct(PAPER["ttft_pdd_vs_cross_dc"]),
         _pct(f["ttft_pdd_vs_cross_dc"]) + " (mean)", dv("ttft")),
        ("P90 TTFT, PDD vs cross-DC PD", _pct(PAPER["p90_ttft_pdd_vs_cross_dc"]),
         _pct(f["p90_ttft_pdd_vs_cross_dc"]), dv("p90")),
        ("relay's share of output tokens", "6.2%", f"{f['relay_share'] * 100:.1f}%",
         dv("relay_share")),
        ("relay's load vs main decode's (x smaller)", "15.2x",
         f"{f['relay_vs_main_load']:.1f}x busy time, {f['relay_vs_main_tokens']:.1f}x tokens", "-"),
        ("decode-side radix cache: WAN saving", "up to 10x", f"{f['drc_wan_saving']:.1f}x "
         f"(MD hit {f['md_hit'] * 100:.1f}%)", dv("drc")),
        ("goodput within SLA vs cross-DC PD", "+27.8%", _pct(f["goodput_vs_cross_dc"]), "-"),
        ("benefit-cost vs same-DC homogeneous", "up to +37.5%",
         _pct(f["benefit_cost_vs_homogeneous"]), "-"),
        ("fleet", "43 A + 32 B vs 88 A", f"{f['fleet_pdd']} vs {f['fleet_homogeneous']}",
         "1 P + 1 RLD + 1 MD"),
    ]  # fmt: skip
    w = [max(len(str(r[i])) for r in rows) for i in range(4)]
    head = ("figure", "paper", "simulated", "demo (make demo)")
    w = [max(a, len(b)) for a, b in zip(w, head, strict=True)]
    lines = ["  ".join(h.ljust(w[i]) for i, h in enumerate(head))]
    lines.append("  ".join("-" * x for x in w))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
    return "\n".join(lines)


def _demo_column() -> dict[str, Any]:
    rec = {(f["pipeline"], f["load"]): f for f in recorded_demo()["figures"]}
    b, p = rec[("baseline", 1.0)], rec[("pdd", 1.0)]
    return {
        "ttft": f"{(p['ttft_p50'] / b['ttft_p50'] - 1) * 100:+.1f}% (p50)",
        "p90": f"{(p['ttft_p90'] / b['ttft_p90'] - 1) * 100:+.1f}%",
        "relay_share": f"{p['relay_share'] * 100:.1f}%",
        "drc": "9.6x (README, a0a7d63)",
    }


def _paper(args: argparse.Namespace) -> int:
    f = paper_figures(args.params or "paper", quick=args.quick, seed=args.seed, sets=args.set)
    out = Path(args.out)
    plots: list[str] = []
    if not args.no_plots:
        plots = write_plots(out, f["cdf"], f["bathtub"], f["sla_ttft_s"])
    f["plots"] = plots
    if args.json:
        emit_json({k: v for k, v in f.items() if k != "cdf"})
        return 0
    print(
        f"the paper's scenario: {f['fleet_pdd']} vs {f['fleet_homogeneous']}, "
        f"{f['rate']:.2f} requests/s for {f['duration_s']:.0f} simulated s per pipeline "
        f"({f['requests']['pdd']} measured requests), {f['sim_seconds']:.0f} s to simulate"
    )
    print(paper_table(f, _demo_column()))
    print("TTFT mean / p50 / p90 / p99 (s):")
    for k in f["ttft_mean"]:
        print(
            f"  {k:9s} {f['ttft_mean'][k]:7.2f} {f['ttft_p50'][k]:7.2f} "
            f"{f['ttft_p90'][k]:7.2f} {f['ttft_p99'][k]:7.2f}"
        )
    g = f["goodput"]
    print(
        f"goodput ({f['sla_quantile']:.0%} within TTFT {f['sla_ttft_s']:.0f} s and "
        f"{f['sla_tpot_s'] * 1e3:.0f} ms per output token, requests/s): "
        f"pdd {g['pdd']:.2f}, cross-DC {g['cross_dc']:.2f}, same-DC homogeneous "
        f"{g['same_dc_homogeneous']:.2f}; costs {f['cost_pdd']:.1f} vs {f['cost_homogeneous']:.1f}"
    )
    print("WAN utilisation: " + ", ".join(f"{k} {v:.2f}" for k, v in f["wan_utilisation"].items()))
    print("benefit-cost vs hit rate (the bathtub), PDD / homogeneous - 1:")
    print("  " + "  ".join(f"{h:.0%} {b * 100:+.0f}%" for h, _, _, b in f["bathtub"][::5]))
    for pth in plots:
        print(f"wrote {pth}")
    return 0


# ---- plots -----------------------------------------------------------------------------------
def write_plots(
    out: Path, cdf: dict[str, list[float]], tub: list[Any], sla_s: float | None = None
) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        from kvbridge.errors import Unavailable

        raise Unavailable(
            "the plots need matplotlib: pip install 'kvbridge-bench[plot]' (make build does)"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in cdf.items():
        xs = [v for v in vals if math.isfinite(v)]
        if not xs:
            continue
        ys = [(i + 1) / len(vals) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name)
    if sla_s:
        ax.axvline(sla_s, color="grey", ls="--", lw=0.8, label="SLA")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_xscale("log")
    ax.legend()
    ax.set_title("TTFT CDF per pipeline")
    fig.tight_layout()
    p1 = out / "ttft_cdf.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    paths.append(str(p1))
    if tub:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([h * 100 for h, *_ in tub], [b * 100 for *_, b in tub], marker=".")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("prefix hit rate (%)")
        ax.set_ylabel("benefit-cost vs homogeneous (%)")
        ax.set_title("benefit against hit rate")
        fig.tight_layout()
        p2 = out / "bathtub.png"
        fig.savefig(p2, dpi=120)
        plt.close(fig)
        paths.append(str(p2))
    return paths


# ---- the planner ------------------------------------------------------------------------------
def _planner(args: argparse.Namespace) -> int:
    from ..plan.paper import Fleet, bathtub, cheapest_fleet, paper_mix, paper_spec, run_fleet
    from ..plan.params import load_params, override
    from ..plan.workload import trace_requests
    from ..sim.trace_format import load_jsonl

    p = override(load_params(args.params or "paper"), args.set)
    sla = args.sla_ttft if args.sla_ttft is not None else float(p["sla.ttft_s"])
    tpot = args.sla_tpot if args.sla_tpot is not None else float(p["sla.tpot_s"])
    qt = args.sla_quantile if args.sla_quantile is not None else float(p["sla.quantile"])
    if args.fleet:
        pr, rl, md = (int(x) for x in args.fleet.split(","))
        start = Fleet(pr, rl, md)
    else:
        start = Fleet(int(p["fleet.prefill_a"]), int(p["fleet.relay_a"]), int(p["fleet.main_b"]))
    spec = paper_spec(p, start)
    requests = None
    if args.trace:
        requests = trace_requests(load_jsonl(args.trace), {spec.md_page_tokens})
        arrivals = [r.arrival for r in requests]
        duration = max(arrivals) - min(arrivals) if arrivals else 0.0
        rate = len(requests) / max(duration, 1e-9)
    else:
        duration = args.duration or (600.0 if args.quick else 1800.0)
        rate = args.rate or 5.0
    mix = paper_mix(p) if args.high_share is None else paper_mix(p, high_share=args.high_share)
    t0 = time.perf_counter()

    def go(f: Fleet, pipeline: str = "pdd") -> Any:
        return run_fleet(
            p, f, pipeline, rate, duration, mix=mix, requests=requests, seed=args.seed,
            warmup_frac=0.4,
        )  # fmt: skip

    def meets(f: Fleet) -> bool:
        return bool(go(f).within(sla, tpot) >= qt)

    if args.no_search:
        best, tried = start, [(start, meets(start))]
    else:
        best, tried = cheapest_fleet(p, meets, start)
    res = {"pdd": go(best), "cross_dc": go(best, "baseline")}
    tub = bathtub(p, [i / 100 for i in range(0, 100, 2)], best, replace(best, same_dc=True))
    f: dict[str, Any] = {
        "params": p.path,
        "rate": rate,
        "duration_s": duration,
        "sla_ttft_s": sla,
        "sla_tpot_s": tpot,
        "sla_quantile": qt,
        "start": start.chips(),
        "meets_sla": bool(tried and tried[0][1]),
        "cheapest": {"prefills": best.prefills, "relays": best.relays, "mains": best.mains,
                     "chips": best.chips(), "cost": best.cost(p)},
        "tried": [(t.prefills, t.relays, t.mains, ok) for t, ok in tried],
        "ttft_p50": {k: r.q(50) for k, r in res.items()},
        "ttft_p90": {k: r.q(90) for k, r in res.items()},
        "ttft_p99": {k: r.q(99) for k, r in res.items()},
        "relay_share": res["pdd"].relay_share(),
        "md_hit": res["pdd"].md_hit(),
        "wan_utilisation": {k: r.wan_utilisation(spec) for k, r in res.items()},
        "cdf": {
            **{k: sorted(r.ttfts()) for k, r in res.items()},
            **{f"pdd {pl}": sorted(res["pdd"].ttfts(pl)) for pl in ("P-MD", "P-RLD-MD", "P-RLD")},
        },
        "bathtub": tub,
        "sim_seconds": time.perf_counter() - t0,
        "parameters": [{"key": k, "value": v, "source": src} for k, v, src in p.rows()],
    }  # fmt: skip
    if not args.no_plots:
        f["plots"] = write_plots(Path(args.out), f["cdf"], tub, sla)
    if args.json:
        emit_json({k: v for k, v in f.items() if k != "cdf"})
        return 0
    print(
        f"plan: {rate:.2f} requests/s for {duration:.0f} simulated s; SLA: {qt:.0%} of the "
        f"requests with TTFT within {sla:.1f} s and {tpot * 1e3:.0f} ms per output token; "
        f"{len(tried)} fleets simulated in {f['sim_seconds']:.0f} s"
    )
    if not f["meets_sla"]:
        print(f"the start fleet {start.chips()} misses the SLA: give a larger --fleet")
    print(f"cheapest fleet meeting it: {best.chips()}, cost {best.cost(p):.1f} (chip-A units)")
    for k in res:
        print(
            f"  {k:9s} TTFT p50 {f['ttft_p50'][k]:6.2f} p90 {f['ttft_p90'][k]:6.2f} "
            f"p99 {f['ttft_p99'][k]:6.2f} s; WAN utilisation {f['wan_utilisation'][k]:.2f}"
        )
    print(f"  relay share {f['relay_share'] * 100:.1f}% of output tokens, MD hit "
          f"{f['md_hit'] * 100:.1f}%")  # fmt: skip
    for pth in f.get("plots", []):
        print(f"wrote {pth}")
    return 0
