"""kvbridge embedded in an engine: an engine thread that computes for a
share of each step and calls a ``SyncBridge`` between its layers and steps.

For each placement (``procs``: one bridge per process, the prefill's and the
decode's, each with its own engine thread; ``inproc``: both bridges in one
process, one engine thread calling both), each transport (TCP; UCX with
``UCX_TLS=tcp``) and each engine load (``python``: the GIL held;
``native``: hashlib, the GIL released; ``sleep``), one run reports

* the engine thread's time inside each kvbridge call it made (p50 / p99 of
  ``send``, ``layers_ready``, ``expect``, ``poll``, ``renew_lease``,
  ``cancel``), over ``--requests`` layer-wise sends of ``--call-tokens``
  tokens, one every few steps, every ``--cancel-every``-th cancelled;
* goodput: ``--repeats`` transfers of ``--tokens`` tokens (SmolLM2-135M's KV:
  30 layers, 3 KV heads of 64, bf16, 16-token pages; 8192 tokens = 189 MB),
  from ``send()`` to the step whose ``poll()`` reported it, while both
  engine threads keep stepping;

and beside them NIXL's post of a prepared transfer (``make_prepped_xfer`` of
the request's per-layer page descriptors + ``transfer``) and its
``check_xfer_state``, timed the same way in the same engine loop
(``UCX_TLS=tcp``).  The ``python`` / ``native`` goodput ratio separates the
GIL from CPU contention: both loads burn the same CPU for the same share of
each step; only one holds the GIL.

  kvbridge-bench embedded
  kvbridge-bench embedded --placements inproc --transports tcp --loads python,native
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing as mp
import statistics
from typing import Any

from kvbridge.errors import KVBridgeError, KVBridgeTimeout

from . import embedded_peers as ep
from .output import emit_json

UCX_ENV = {"UCX_TLS": "tcp"}
CALLS = ("send", "layers_ready", "expect", "poll", "renew_lease", "cancel", "control")
NIXL_CALLS = ("make_prepped_xfer+transfer", "check_xfer_state", "control")
NIXL_DESCS = {
    "pages": "nixl-ucx (a descriptor per layer, K/V and page, as vLLM's NIXL connector posts)",
    "one": "nixl-ucx-1 (one descriptor per request: the request's KV contiguous)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placements", default="procs,inproc", help="procs, inproc")
    p.add_argument("--transports", default="tcp,ucx", help="tcp, ucx (UCX_TLS=tcp)")
    p.add_argument("--loads", default="python,native,sleep", help="python, native, sleep")
    p.add_argument("--load-on", default="both", choices=["both", "prefill", "decode"],
                   help="procs: which engine threads run the load (the other sleeps)")  # fmt: skip
    p.add_argument("--share", type=float, default=0.9, help="busy share of each step")
    p.add_argument("--step-ms", type=float, default=2.0, help="engine step length")
    p.add_argument("--tokens", type=int, default=8192, help="goodput transfer size (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="goodput transfers per config")
    p.add_argument("--call-tokens", type=int, default=256, help="tokens of a timed request")
    p.add_argument("--requests", type=int, default=100, help="timed requests per config")
    p.add_argument("--cancel-every", type=int, default=10, help="cancel every n-th request")
    p.add_argument("--phase", default="all", choices=["all", "calls", "goodput"])
    p.add_argument("--switch-ms", type=float, default=None,
                   help="the interpreter's switch interval in the bridges' processes (default 5)")  # fmt: skip
    p.add_argument("--no-nixl", action="store_true", help="leave the NIXL rows out")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _recv(conn: Any, what: str, timeout: float = 600) -> Any:
    if not conn.poll(timeout):
        raise KVBridgeTimeout(f"{what}: no answer in {timeout} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise KVBridgeError(f"{what}: {msg[1]}")
    return msg[1]


def _run_kvb(placement: str, via: str, load: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    env = UCX_ENV if via == "ucx" else {}
    cfg = {
        "via": via, "load": load, "load_on": args.load_on, "share": args.share,
        "step_ms": args.step_ms, "tokens": args.tokens, "repeats": args.repeats,
        "call_tokens": args.call_tokens, "requests": args.requests,
        "cancel_every": args.cancel_every, "phase": args.phase, "switch_ms": args.switch_ms,
    }  # fmt: skip
    if placement == "inproc":
        a, b = ctx.Pipe()
        proc = ctx.Process(target=ep.inproc_main, args=(b, env, cfg), daemon=True)
        proc.start()
        try:
            return dict(_recv(a, f"inproc {via} {load}"))
        finally:
            proc.join(30)
            proc.kill()
    d_parent, d_child = ctx.Pipe()
    p_parent, p_child = ctx.Pipe()
    link_d, link_p = ctx.Pipe()  # decode <-> prefill: its address, tickets, stop
    dec = ctx.Process(target=ep.decode_main, args=(d_child, link_d, env, cfg), daemon=True)
    pre = ctx.Process(target=ep.prefill_main, args=(p_child, link_p, env, cfg), daemon=True)
    dec.start()
    pre.start()
    try:
        out = dict(_recv(p_parent, f"procs {via} {load} (prefill)"))
        dres = _recv(d_parent, f"procs {via} {load} (decode)", 60)
        for name, ns in dres.get("calls", {}).items():
            out.setdefault("calls", {}).setdefault(name, []).extend(ns)
        return out
    finally:
        for proc in (pre, dec):
            proc.join(30)
            proc.kill()


def _run_nixl(load: str, descs: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    cfg = {
        "load": load, "share": args.share, "step_ms": args.step_ms, "descs": descs,
        "call_tokens": args.call_tokens, "requests": args.requests,
        "pages": ep.SMOL.pages_for(args.call_tokens) * 8,
    }  # fmt: skip
    _t_parent, t_child = ctx.Pipe()
    i_parent, i_child = ctx.Pipe()
    link_t, link_i = ctx.Pipe()
    tgt = ctx.Process(target=ep.nixl_target_main, args=(t_child, link_t, UCX_ENV, cfg), daemon=True)
    ini = ctx.Process(
        target=ep.nixl_initiator_main, args=(i_child, link_i, UCX_ENV, cfg), daemon=True
    )
    tgt.start()
    ini.start()
    try:
        return dict(_recv(i_parent, f"nixl {load}"))
    finally:
        for proc in (ini, tgt):
            proc.join(10)
            proc.kill()


def _pct(ns: list[int], q: float) -> float:
    s = sorted(ns)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


def _mbps(tokens: int, seconds: list[float]) -> list[float]:
    nbytes = tokens * ep.SMOL.bytes_per_token
    return [nbytes / s / 1e6 for s in seconds if s and not math.isnan(s)]


def run(args: argparse.Namespace) -> int:
    placements = [x for x in args.placements.split(",") if x]
    vias = [x for x in args.transports.split(",") if x]
    loads = [x for x in args.loads.split(",") if x]
    nbytes = args.tokens * ep.SMOL.bytes_per_token
    print(
        f"# SmolLM2-135M KV ({ep.SMOL.bytes_per_token} B/token); goodput transfer "
        f"{args.tokens} tokens = {nbytes / 1e6:.0f} MB; calls: {args.requests} layer-wise "
        f"sends of {args.call_tokens} tokens; step {args.step_ms:g} ms, load {args.share:.0%} "
        f"of it (on {args.load_on if 'procs' in placements else 'the one engine thread'})",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for placement in placements:
        for via in vias:
            for load in loads:
                res = _run_kvb(placement, via, load, args)
                mb = _mbps(args.tokens, res.get("seconds", []))
                calls: dict[str, Any] = {}
                for name in CALLS:
                    ns = res.get("calls", {}).get(name, [])
                    if ns:
                        calls[name] = {"n": len(ns), "p50_us": _pct(ns, 0.5),
                                       "p99_us": _pct(ns, 0.99)}  # fmt: skip
                row = {"placement": placement, "transport": via, "load": load,
                       "goodput_mb_s": mb, "calls": calls}  # fmt: skip
                if res.get("resent"):
                    row["resent"] = res["resent"]
                    print(f"# goodput transfers (chunks resent, wire bytes): {res['resent']}")
                if res.get("cpu"):
                    row["cpu_s"] = res["cpu"]
                    print(f"# CPU seconds by thread over the goodput phase: {res['cpu']}")
                errors = res.get("errors") or []
                if errors:
                    row["errors"] = errors
                    print(f"# {len(errors)} failed: {errors[:3]}", flush=True)
                rows.append(row)
                _print_row(row)
    nixl_rows: list[dict[str, Any]] = []
    if not args.no_nixl and args.phase != "goodput":
        if importlib.util.find_spec("nixl") is None:
            print("missing: nixl (pip install nixl); NIXL rows skipped")
        else:
            for descs in ("pages", "one"):
                print(f"# {NIXL_DESCS[descs]}")
                for load in loads:
                    _nixl_row(nixl_rows, load, descs, args)
    _summary(rows, nixl_rows, loads, args)
    if args.json:
        emit_json({"rows": rows, "nixl": nixl_rows, "tokens": args.tokens, "bytes": nbytes})
    return 0


def _nixl_row(nixl_rows: list[dict[str, Any]], load: str, descs: str, args: Any) -> None:
    res = _run_nixl(load, descs, args)
    name_t = "nixl-ucx" if descs == "pages" else "nixl-ucx-1"
    calls: dict[str, Any] = {}
    for name in NIXL_CALLS:
        ns = res.get("calls", {}).get(name, [])
        if ns:
            calls[name] = {"n": len(ns), "p50_us": _pct(ns, 0.5), "p99_us": _pct(ns, 0.99)}
    row = {"placement": "procs", "transport": name_t, "load": load, "calls": calls}
    nixl_rows.append(row)
    _print_row(row)


def _print_row(row: dict[str, Any]) -> None:
    calls = "  ".join(
        f"{name} {c['p50_us']:.1f}/{c['p99_us']:.1f}" for name, c in row["calls"].items()
    )
    mb = row.get("goodput_mb_s") or []
    gp = f"{statistics.median(mb):.0f} MB/s [{min(mb):.0f}-{max(mb):.0f}]" if mb else "-"
    print(f"{row['placement']:6} {row['transport']:8} {row['load']:6}  goodput {gp}  "
          f"calls p50/p99 us: {calls}", flush=True)  # fmt: skip


def _summary(
    rows: list[dict[str, Any]],
    nixl: list[dict[str, Any]],
    loads: list[str],
    args: argparse.Namespace,
) -> None:
    print("\n## goodput (MB/s, median [range] of the repeats) by engine load")
    print(f"| placement | transport | {' | '.join(loads)} | python / native |")
    print("|---|---|" + "---|" * (len(loads) + 1))
    keys = sorted({(r["placement"], r["transport"]) for r in rows}, reverse=True)
    for pl, tr in keys:
        cells, med = [], {}
        for load in loads:
            r = next(
                (x for x in rows if (x["placement"], x["transport"], x["load"]) == (pl, tr, load)),
                None,
            )
            mb = (r or {}).get("goodput_mb_s") or []
            if mb:
                med[load] = statistics.median(mb)
                cells.append(f"{med[load]:.0f} [{min(mb):.0f}-{max(mb):.0f}]")
            else:
                cells.append("-")
        ratio = (
            f"{med['python'] / med['native']:.2f}x" if "python" in med and "native" in med else "-"
        )
        print(f"| {pl} | {tr} | {' | '.join(cells)} | {ratio} |")
    print("\n## the engine thread's time inside each call (us, p50 / p99)")
    names = list(dict.fromkeys(CALLS + NIXL_CALLS))
    print("| placement | transport | load | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for r in rows + nixl:
        cells = []
        for n in names:
            c = r["calls"].get(n)
            cells.append(f"{c['p50_us']:.1f} / {c['p99_us']:.1f}" if c else "")
        print(f"| {r['placement']} | {r['transport']} | {r['load']} | " + " | ".join(cells) + " |")
