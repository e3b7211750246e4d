"""Small-transfer latency: 4 KiB and 64 KiB put-to-landed-at-receiver over
kvbridge UCX (UCX_TLS=tcp and tcp,sm) and kvbridge TCP, against NIXL (UCX
backend, the same two UCX_TLS) and a raw uvloop ping-pong of the same bytes.

Every configuration runs as two processes that ping-pong one buffer; a leg
completes when the receiver knows the bytes landed, and half a round trip is
one sample.  Side A also records the sender's own completion (kvbridge's send
handle, NIXL's transfer state DONE: both mean flushed at the target).  All
pairs stay up and take turns (--rounds rounds of --burst samples each, after
--warmup), so load swings hit every row alike.  Rows show the median and the
P99, and ratios against uvloop and NIXL over the same UCX_TLS measured in the
same run.  ``--busy`` adds a load point with one core kept busy by a spinning
process.

At the idle load point the two sides of every pair run pinned to two CPUs
(``--placement pinned``, the default: each side and all its threads on its
own CPU), the same for every row.  Left to the kernel (``--placement os``),
the sides of a pair, asleep between their turns, are sometimes woken onto
one CPU and stay there for the short burst of their turn (load balancing
takes a few milliseconds), and the pair's legs then measure the scheduler
sharing that CPU, not the transport: ``--placement shared`` measures that
case on purpose.  With a core busy the kernel places the sides (pinned, one
side would share the busy core by construction).

``--baseline DIR`` adds kvbridge TCP rows run by another kvbridge source tree
(say the commit before a change: ``git archive <commit> kvbridge | tar -x -C
DIR``), beside the current ones, so that before and after are measured side
by side.  ``--breakdown`` also shows where the time of one small TCP transfer
goes (each frame sent and read, each task, each hop to a worker thread, on
the shared monotonic clock of both processes; the baseline's too), and times
the pieces of one small UCX put in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import KVBridgeError, KVBridgeTimeout, PeerGone

from .compare import SEG_ENV, TUNED, spinning_core  # kvbridge's own UCX settings, for NIXL too
from .latency_peers import side_main

UCX_ENV = {"tcp": {"UCX_TLS": "tcp"}, "tcp,sm": {"UCX_TLS": "tcp,sm"}}
# NIXL set up as its documentation recommends on a small machine: no progress
# thread (get_new_notifs / check_xfer_state progress the worker), and the
# same endpoint error mode and TCP segments as kvbridge.
NIXL_TUNED = {
    "progress_thread": False,
    "params": {"ucx_error_handling_mode": "none"},
}


@dataclass
class Config:
    name: str
    kind: str
    env: dict[str, str]
    opts: dict[str, Any]
    setting: str  # printed beside the row
    tls: str = ""
    samples: list[float] = field(default_factory=list)
    sender: list[float] = field(default_factory=list)
    bursts: list[list[float]] = field(default_factory=list)  # the samples of each burst
    error: str = ""


TCP_SETTING = "1 stream, no compression, checksums on"
# Where the two sides of a pair run at the idle load point: "pinned", side 0
# on one CPU and side 1 on another (all their threads), as latency
# benchmarks are run; "shared", both on one CPU; "os", where the kernel
# places them.  With a core busy the kernel always places them (pinned, one
# side would share the busy core by construction).
PLACEMENTS = ("pinned", "shared", "os")


def configs(
    tls_list: list[str],
    libs: list[str],
    busy_poll_us: int | list[int],
    poll_yield_us: list[int] | None = None,
    baseline: str | None = None,
) -> list[Config]:
    """The rows: every combination of a ``busy_poll_us`` and a
    ``poll_yield_us`` value (awaiting), then a polling row per
    ``poll_yield_us`` value (the first busy_poll_us), per UCX_TLS; the
    first value of each list is the default.
    ``baseline``: a kvbridge source tree whose TCP row runs beside the
    current one."""
    polls = [busy_poll_us] if isinstance(busy_poll_us, int) else list(busy_poll_us)
    yields = list(poll_yield_us or [0])
    out = []
    if "uvloop" in libs:
        out.append(Config("uvloop ping-pong", "uvloop", {}, {}, "asyncio streams, TCP_NODELAY"))
    if "kvb-tcp" in libs:
        out.append(Config("kvbridge TCP", "kvb-tcp", {}, {}, TCP_SETTING))
        if baseline:
            out.append(
                Config(
                    "kvbridge TCP baseline",
                    "kvb-tcp",
                    {},
                    {"tree": baseline},
                    f"{TCP_SETTING}; the kvbridge of {baseline}",
                )
            )
    for tls in tls_list:
        ucx_rows = [(bp, y) for bp in polls for y in yields]
        for bp, py in ucx_rows if "kvb-ucx" in libs else []:
            suffix = "" if bp == polls[0] else f" bp={bp}"
            suffix += "" if py == yields[0] else f" y={py}"
            out.append(
                Config(
                    f"kvbridge UCX {tls}{suffix}",
                    "kvb-ucx",
                    UCX_ENV[tls],
                    {"busy_poll_us": bp, "poll_yield_us": py},
                    f"await; busy_poll_us={bp}, poll_yield_us={py}, progress=thread, "
                    "error_mode=none",
                    tls,
                )
            )
        for py in yields if "kvb-ucx-poll" in libs else []:
            suffix = "" if py == yields[0] else f" y={py}"
            out.append(
                Config(
                    f"kvbridge UCX {tls} poll{suffix}",
                    "kvb-ucx",
                    UCX_ENV[tls],
                    {"busy_poll_us": polls[0], "poll_yield_us": py, "mode": "poll"},
                    f"polls done(); busy_poll_us={polls[0]}, poll_yield_us={py}, "
                    "progress=thread, error_mode=none",
                    tls,
                )
            )
        if "kvb-ucx-prep" in libs:
            out.append(
                Config(
                    f"kvbridge UCX {tls} prepared",
                    "kvb-ucx",
                    UCX_ENV[tls],
                    {
                        "busy_poll_us": polls[0],
                        "poll_yield_us": yields[0],
                        "mode": "poll",
                        "prepared": True,
                    },
                    "one send prepared (prepare_send), posted per request id, as NIXL's "
                    f"re-posted handle; polls done(); busy_poll_us={polls[0]}, "
                    f"poll_yield_us={yields[0]}, progress=thread, error_mode=none",
                    tls,
                )
            )
        engine_rows = [
            ("engine calls", True, True, "the post and the wait"),
            ("engine post", True, False, "the post; done() polled as in the prepared row"),
            ("engine wait", False, True, "the wait; post() as in the prepared row"),
        ]
        for name, engine_post, engine_wait, what in engine_rows if "kvb-ucx-engine" in libs else []:
            out.append(
                Config(
                    f"kvbridge UCX {tls} {name}",
                    "kvb-ucx-engine",
                    UCX_ENV[tls],
                    {
                        "busy_poll_us": polls[0],
                        "poll_yield_us": yields[0],
                        "engine_post": engine_post,
                        "engine_wait": engine_wait,
                    },
                    f"the prepared row with the engine's calls in place of the API on {what} "
                    "(put_prepared, poll_take: no handle on the path)",
                    tls,
                )
            )
        if baseline and "kvb-ucx" in libs:
            out.append(
                Config(
                    f"kvbridge UCX {tls} baseline",
                    "kvb-ucx",
                    UCX_ENV[tls],
                    {"busy_poll_us": polls[0], "poll_yield_us": yields[0], "tree": baseline},
                    f"as the first await row; the kvbridge of {baseline}",
                    tls,
                )
            )
        if baseline and "kvb-ucx-poll" in libs:
            out.append(
                Config(
                    f"kvbridge UCX {tls} poll baseline",
                    "kvb-ucx",
                    UCX_ENV[tls],
                    {
                        "busy_poll_us": polls[0],
                        "poll_yield_us": yields[0],
                        "mode": "poll",
                        "tree": baseline,
                    },
                    f"as the poll row; the kvbridge of {baseline} (its compiled modules "
                    "copied beside it)",
                    tls,
                )
            )
        nixl_rows = [
            (
                "nixl",
                "",
                NIXL_TUNED,
                f"one handle re-posted; progress thread off, ucx_error_handling_mode=none, {TUNED}",
            ),
            (
                "nixl-req",
                " per request",
                {**NIXL_TUNED, "per_request": True},
                "a handle per request (make_prepped_xfer, notification = request id, "
                "released when DONE), as vLLM's NIXL connector; otherwise as the NIXL row",
            ),
        ]
        for lib, suffix, nixl_opts, setting in nixl_rows:
            if lib in libs:
                env = {**UCX_ENV[tls], **SEG_ENV}
                out.append(Config(f"NIXL {tls}{suffix}", "nixl", env, nixl_opts, setting, tls))
    return out


def side_cpus(placement: str) -> tuple[int, int] | None:
    """The CPUs of side 0 and side 1 for ``placement`` (of the CPUs this
    process may use: the first two for "pinned", the first for "shared"),
    or None ("os", or "pinned" with fewer than two CPUs)."""
    if placement not in PLACEMENTS:
        raise KVBridgeError(f"placement {placement!r}: one of {', '.join(PLACEMENTS)}")
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "shared":
        return cpus[0], cpus[0]
    return (cpus[0], cpus[1]) if placement == "pinned" and len(cpus) >= 2 else None


def placement_line(placement: str) -> str:
    cpus = side_cpus(placement)
    if cpus is None:
        return "the kernel places the two sides of every pair"
    return f"side 0 of every pair on CPU {cpus[0]}, side 1 on CPU {cpus[1]}"


class Pair:
    def __init__(
        self, cfg: Config, size: int, count: int, cpus: tuple[int, int] | None = None
    ) -> None:
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self.conns = []
        self.procs = []
        opts = dict(cfg.opts)
        if cfg.kind == "kvb-tcp":
            opts["count"] = count
        for role in (0, 1):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=side_main,
                args=(child, cfg.kind, role, cfg.env, size, opts, cpus[role] if cpus else None),
                daemon=True,
                name=f"{cfg.name} side {role}",
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def get(self, i: int, timeout: float) -> Any:
        c, p = self.conns[i], self.procs[i]
        end = time.monotonic() + timeout
        while not c.poll(0.1):
            if not p.is_alive() and not c.poll(0.1):
                raise PeerGone(f"{p.name} exited with code {p.exitcode}")
            if time.monotonic() > end:
                raise KVBridgeTimeout(f"{p.name}: no answer within {timeout} s")
        msg = c.recv()
        if msg[0] == "error":
            raise KVBridgeError(f"{p.name}: {msg[1]}")
        return msg

    def start(self, timeout: float) -> None:
        a, b = self.get(0, timeout), self.get(1, timeout)
        self.conns[0].send(b[1])
        self.conns[1].send(a[1])
        self.get(0, timeout)
        self.get(1, timeout)

    def burst(self, n: int, timeout: float) -> tuple[list[float], list[float]]:
        a, _ = self.burst_both(n, timeout)
        return a[1], a[2]

    def burst_both(self, n: int, timeout: float) -> tuple[Any, Any]:
        for c in self.conns:
            c.send(("run", n))
        return self.get(0, timeout), self.get(1, timeout)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("quit",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()


def measure(
    cfgs: list[Config],
    size: int,
    warmup: int,
    rounds: int,
    burst: int,
    timeout: float,
    placement: str = "pinned",
) -> None:
    cpus = side_cpus(placement)
    pairs: list[Pair] = []
    try:
        for cfg in cfgs:
            pair = Pair(cfg, size, warmup + rounds * burst + 8, cpus)
            try:
                pair.start(timeout)
                pair.burst(warmup, timeout)
                pairs.append(pair)
            except KVBridgeError as e:
                cfg.error = str(e)
                pair.close()
        for _ in range(rounds):
            for pair in pairs:
                if pair.cfg.error:
                    continue
                try:
                    s, snd = pair.burst(burst, timeout)
                    pair.cfg.samples += s
                    pair.cfg.bursts.append(s)
                    pair.cfg.sender += snd
                except KVBridgeError as e:
                    pair.cfg.error = str(e)
    finally:
        for pair in pairs:
            pair.close()


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def format_rows(cfgs: list[Config], size: int, load: str) -> str:
    by = {c.name: c for c in cfgs}
    uv = by.get("uvloop ping-pong")
    head = (
        f"{'size':>6} {'load':<9} {'row':<34} {'median us':>9} {'P99 us':>8} {'sender us':>9} "
        f"{'vs uvloop':>9} {'vs NIXL':>8} {'sender vs NIXL':>14} {'vs NIXL/req':>11}  setting"
    )
    lines = [head, "-" * len(head)]
    for c in cfgs:
        if c.error or not c.samples:
            lines.append(f"{size:>6} {load:<9} {c.name:<34} error: {c.error or 'no samples'}")
            continue
        med = statistics.median(c.samples) * 1e6
        snd = statistics.median(c.sender) * 1e6 if c.sender else float("nan")
        nixl = by.get(f"NIXL {c.tls}") if c.tls else None
        per_req = by.get(f"NIXL {c.tls} per request") if c.tls else None
        r_uv = f"{med / (statistics.median(uv.samples) * 1e6):.2f}x" if uv and uv.samples else "-"
        r_nx = r_snd = r_req = "-"
        if nixl is not None and nixl.samples and c.kind != "nixl":
            r_nx = f"{med / (statistics.median(nixl.samples) * 1e6):.2f}x"
            r_snd = f"{snd / (statistics.median(nixl.sender) * 1e6):.2f}x"
        if per_req is not None and per_req.samples and c.kind != "nixl":
            r_req = f"{med / (statistics.median(per_req.samples) * 1e6):.2f}x"
        lines.append(
            f"{size:>6} {load:<9} {c.name:<34} {med:9.1f} {_p99(c.samples) * 1e6:8.1f} {snd:9.1f} "
            f"{r_uv:>9} {r_nx:>8} {r_snd:>14} {r_req:>11}  {c.setting}"
        )
    return "\n".join(lines)


def format_positions(cfgs: list[Config], size: int, load: str) -> str:
    """Each row's median by position in its bursts (us): a row whose first
    legs after a pause are slow (a wake-up, a path that is cold in the
    caches while the other rows ran) shows it here, apart from its steady
    state at the end of the burst."""
    lines = []
    for c in cfgs:
        full = [b for b in c.bursts if b and len(b) == len(c.bursts[0])]
        if c.error or not full:
            continue
        n = len(full[0])
        picks = sorted(
            {i for i in (0, 1, 2, 3, 4, 9, 14, 19, 24, 49, 99, 199, 399) if i < n} | {n - 1}
        )
        meds = [statistics.median(b[i] for b in full) * 1e6 for i in picks]
        cells = " ".join(f"{i + 1}:{m:.1f}" for i, m in zip(picks, meds, strict=True))
        lines.append(f"{size:>6} {load:<9} {c.name:<34} {cells}")
    head = (
        f"# median by position in the burst (leg: us), {len(cfgs[0].bursts) if cfgs else 0} bursts"
    )
    return "\n".join([head, *lines])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="4096,65536", help="comma list of byte sizes")
    p.add_argument("--tls", default="tcp,tcp+sm", help="UCX_TLS settings: tcp, tcp+sm (tcp,sm)")
    p.add_argument(
        "--libs",
        default="uvloop,kvb-tcp,kvb-ucx,kvb-ucx-poll,kvb-ucx-prep,nixl,nixl-req",
        help="comma list of uvloop, kvb-tcp, kvb-ucx (awaiting), kvb-ucx-poll (polling done()), "
        "kvb-ucx-prep (one prepared send posted per request, polling), kvb-ucx-engine (the "
        "prepared row with the engine's calls in place of the API on the post, the wait, or "
        "both: three rows), nixl (one transfer handle re-posted), nixl-req (a handle per "
        "request, as vLLM's NIXL connector)",
    )
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--burst", type=int, default=25, help="samples per row per round")
    p.add_argument(
        "--positions",
        action="store_true",
        help="also print each row's median by position in the burst (the first legs after a "
        "pause against the steady state)",
    )
    p.add_argument(
        "--busy-poll-us",
        default="1000",
        help="kvbridge UCX busy_poll_us: a comma list gives one row each (the first is the default)",
    )
    p.add_argument(
        "--poll-yield-us",
        default="0",
        help="kvbridge UCX poll_yield_us: a comma list gives one row each (the first is the default)",
    )
    p.add_argument("--busy", action="store_true", help="also measure with one core kept busy")
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="pinned",
        help="where the two sides of every pair run at the idle load point: pinned, side 0 on "
        "the first CPU and side 1 on the second (default); shared, both on the first; os, where "
        "the kernel places them (with a core busy, always there)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also show where the time of one small TCP transfer goes (two processes) "
        "and time the pieces of one small UCX put (one process)",
    )
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="a kvbridge source tree whose TCP rows (and breakdown) and first UCX await and poll "
        "rows run beside the current ones (for UCX, copy the compiled kvbridge/*.so into it)",
    )
    p.add_argument(
        "--trace-count", type=int, default=300, help="transfers traced by --breakdown (TCP, UCX)"
    )
    p.add_argument("--timeout", type=float, default=120.0)


def run(args: Any) -> int:
    libs = [x for x in args.libs.split(",") if x]
    if importlib.util.find_spec("nixl") is None and {"nixl", "nixl-req"} & set(libs):
        print("missing: nixl (pip install nixl); skipped")
        libs = [lib for lib in libs if lib not in ("nixl", "nixl-req")]
    tls = [t.replace("+", ",") for t in args.tls.split(",") if t]
    ok = True
    loads = ["idle", "1 busy"] if args.busy else ["idle"]
    print(f"# kvbridge-bench latency {' '.join(sys.argv[2:])}")
    cpus = side_cpus(args.placement)
    baseline = getattr(args, "baseline", None)
    for load in loads:
        for size in [int(s) for s in args.sizes.split(",")]:
            cfgs = configs(
                tls,
                libs,
                [int(x) for x in str(args.busy_poll_us).split(",")],
                [int(x) for x in str(args.poll_yield_us).split(",")],
                baseline,
            )
            placement = args.placement if load == "idle" else "os"
            print(f"# {size} bytes, {load}: {placement_line(placement)}")
            with spinning_core(load != "idle"):
                measure(cfgs, size, args.warmup, args.rounds, args.burst, args.timeout, placement)
            print(format_rows(cfgs, size, load), flush=True)
            if getattr(args, "positions", False):
                print(format_positions(cfgs, size, load), flush=True)
            ok = ok and all(not c.error for c in cfgs)
    if args.breakdown and "kvb-tcp" in libs:
        trees = [("current", None)] + ([("baseline", baseline)] if baseline else [])
        for size in [int(s) for s in args.sizes.split(",")]:
            for label, tree in trees:
                trace, legs, total = tcp_trace(size, args.trace_count, tree, args.timeout, cpus)
                print(
                    f"# where the time goes: one {size}-byte kvbridge TCP transfer ({label}), "
                    f"two processes, {legs} of {total} transfers in this order, median times"
                )
                for at, step, what in trace:
                    print(f"  {at:9.1f} us  +{step:8.1f}  {what}")
    if args.breakdown and "kvb-ucx" in libs:
        for t in tls:
            for size in [int(s) for s in args.sizes.split(",")]:
                ctx = mp.get_context("spawn")
                with ctx.Pool(1) as pool:  # its own process: UCX_TLS is read at start
                    rows = pool.apply(breakdown, (t, size))
                print(f"# where the time goes: UCX_TLS={t}, {size} bytes, one process")
                for name, us in rows:
                    print(f"  {name:<44} {us:8.2f} us")
                first = {
                    "busy_poll_us": int(str(args.busy_poll_us).split(",")[0]),
                    "poll_yield_us": int(str(args.poll_yield_us).split(",")[0]),
                }
                for mode in ("await", "poll"):
                    steps, half = ucx_trace(
                        t, size, args.trace_count, mode, first, args.timeout, cpus
                    )
                    print(
                        f"# where the time goes: UCX_TLS={t}, {size} bytes, two processes "
                        f"ping-ponging ({mode}; {first}), median of {args.trace_count} legs "
                        f"less the first fifth: half a round trip {half:.1f} us"
                    )
                    for name, us in steps:
                        print(f"  {name:<66} {us:8.1f} us")
    return 0 if ok else 1


# ---- where the time goes: one small TCP transfer, traced in both processes ---------------------
def tcp_trace(
    size: int, count: int, tree: str | None, timeout: float, cpus: tuple[int, int] | None = None
) -> tuple[list[tuple[float, float, str]], int, int]:
    """Send ``count`` transfers of ``size`` bytes one at a time from side 0
    to side 1 with every frame, handle, task and thread hop recorded on both
    sides (latency_peers._instrument).  Returns, for the event order most
    transfers took (the first fifth dropped as warm-up): each event's median
    time after ``send()`` was called and after the event before it, in
    microseconds; and how many transfers took that order, of how many."""
    from collections import Counter

    opts: dict[str, Any] = {"count": count + 8}
    if tree:
        opts["tree"] = tree
    cfg = Config("kvbridge TCP traced", "kvb-tcp-trace", {}, opts, TCP_SETTING)
    pair = Pair(cfg, size, count + 8, cpus)
    try:
        pair.start(timeout)
        a, b = pair.burst_both(count, timeout)
    finally:
        pair.close()
    events = sorted(
        [(t, "sender: " + e) for t, e in a[1]] + [(t, "receiver: " + e) for t, e in b[1]]
    )
    legs: list[list[tuple[float, str]]] = []
    for t, e in events:
        if e == "sender: send() called":
            legs.append([])
        if legs:
            legs[-1].append((t, e))
    legs = legs[len(legs) // 5 :]
    order, n = Counter(tuple(e for _, e in leg) for leg in legs).most_common(1)[0]
    same = [leg for leg in legs if tuple(e for _, e in leg) == order]
    rows = []
    for i, what in enumerate(order):
        at = statistics.median(leg[i][0] - leg[0][0] for leg in same) * 1e6
        step = statistics.median(leg[i][0] - leg[i - 1][0] for leg in same) * 1e6 if i else 0.0
        rows.append((at, step, what))
    return rows, n, len(legs)


# ---- where the time goes: one process, two agents, timed piece by piece -----------------------
def breakdown(tls: str, size: int, n: int = 2000) -> list[tuple[str, float]]:
    """Median microseconds of each piece of a small put on the UCX path, in
    one process (the receiving agent's progress thread answers)."""
    import asyncio
    import os

    import numpy as np

    os.environ["UCX_TLS"] = tls
    from kvbridge.transport.ucx import UcxAgent
    from kvbridge.transport.ucx.loader import load

    from .latency_peers import page_layout

    mod = load()

    lay = page_layout(size)
    out: list[tuple[str, float]] = []

    def timed(name: str, fn: Any) -> None:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out.append((name, statistics.median(ts) * 1e6))

    async def main() -> None:
        ca = np.zeros(lay.cache_shape(2), dtype=np.uint16)
        cb = np.zeros(lay.cache_shape(2), dtype=np.uint16)
        key = b"kvbridge bench pair"
        a = UcxAgent(lay, ca, staging_bytes=0, min_put_run_bytes=0, psk=key)
        b = UcxAgent(lay, cb, staging_bytes=0, min_put_run_bytes=0, psk=key)
        peer = await a.connect(b.metadata())
        bt = np.array([0], dtype=np.int64)
        for i in range(100):
            await peer.send(f"w{i}", bt, bt, 0, 16)
        plan = peer._plan
        timed("page runs in C++ (RunPlan.runs)", lambda: plan.runs(bt, bt, 0, 16, 0, 1))
        timed(
            "DONE message encoding in C++ (for scale; put_range does it)",
            lambda: mod.encode_done(a.agent_id, b"r", 0, 16, 0, 1, size),
        )
        eng = a._engine  # the compiled engine: runs, put, flush and DONE, progressed inline
        ts, inline = [], 0
        for _ in range(n):
            t0 = time.perf_counter()
            _, status, _, _ = eng.put_range(
                peer._ep, plan, bt, bt, 0, 16, 0, 1, b"r", 0, a._busy_poll_us
            )
            ts.append(time.perf_counter() - t0)
            inline += status == 0
            await asyncio.sleep(0)  # let the receiving agent's loop poll, as in real use
        out.append(
            (
                f"engine runs + put + flush + DONE ({inline / n:.0%} inline)",
                statistics.median(ts) * 1e6,
            )
        )
        timed("handle creation", lambda: a._new_handle("r", "send", size, 30.0, armed=False))
        loop = asyncio.get_running_loop()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fut = loop.create_future()
            loop.call_soon(fut.set_result, None)
            await fut
            ts.append(time.perf_counter() - t0)
        out.append(("one asyncio wake-up (future via call_soon)", statistics.median(ts) * 1e6))
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            await peer.send(f"s{i}", bt, bt, 0, 16)
            ts.append(time.perf_counter() - t0)
        out.append(("peer.send + await, whole", statistics.median(ts) * 1e6))
        await a.close()
        await b.close()

    asyncio.run(main())
    return out


# ---- where the time goes: one small UCX put, two processes, on their shared clock ---------------
UCX_TRACE_STEPS = (
    "A: send() call, returned (put, flush, DONE posted inline)",
    "A: send() returned -> B: expect resolved (DONE seen, accounted)",
    "B: expect resolved -> B: task resumed (loop hop)",
    "B: send() call, returned",
    "B: send() returned -> A: expect resolved",
    "A: expect resolved -> A: task resumed",
)


def ucx_trace(
    tls: str,
    size: int,
    count: int,
    mode: str,
    opts: dict[str, Any],
    timeout: float,
    cpus: tuple[int, int] | None = None,
) -> tuple[list[tuple[str, float]], float]:
    """Ping-pong ``count`` legs of ``size`` bytes between two processes over
    ``UCX_TLS=tls`` (``mode`` "await" or "poll"), each side stamping its
    steps on the monotonic clock they share (latency_peers._kvb_ucx_trace).
    Returns the median microseconds of each of UCX_TRACE_STEPS (the first
    fifth of the legs dropped as warm-up) and the median half round trip."""
    cfg = Config("kvbridge UCX traced", "kvb-ucx-trace", UCX_ENV[tls], {**opts, "mode": mode}, "")
    pair = Pair(cfg, size, count, cpus)
    try:
        pair.start(timeout)
        a, b = pair.burst_both(count, timeout)
    finally:
        pair.close()
    return trace_steps(a[1][count // 5 :], b[1][count // 5 :])


def trace_steps(
    a_legs: list[tuple[float, ...]], b_legs: list[tuple[float, ...]]
) -> tuple[list[tuple[str, float]], float]:
    """The median of each of UCX_TRACE_STEPS and of half a round trip, in
    microseconds, from side A's stamps (send() called, returned, its expect
    resolved, its task resumed) and side B's (its expect resolved, send()
    called, returned) of the same legs; raises KVBridgeError for a leg whose
    stamps are out of causal order."""
    legs = list(zip(a_legs, b_legs, strict=True))
    if not legs:
        raise KVBridgeError("UCX trace: no legs")
    steps: list[list[float]] = [[] for _ in UCX_TRACE_STEPS]
    half = []
    for (a0, a1, a_he, a_back), (b_he, b0, b1) in legs:
        # (a DONE is posted inside send(): the other side may see it before
        # that call returns, never before it was made)
        if not (a0 <= a1 and a0 <= b_he <= b0 <= b1 and b0 <= a_he <= a_back):
            raise KVBridgeError(
                "UCX trace: a leg's stamps are out of order (each expect must resolve after "
                f"the other side's send() was called): A {a0, a1, a_he, a_back}, B {b_he, b0, b1}"
            )
        for i, d in enumerate((a1 - a0, b_he - a1, b0 - b_he, b1 - b0, a_he - b1, a_back - a_he)):
            steps[i].append(d)
        half.append((a_back - a0) / 2)
    rows = [
        (name, statistics.median(xs) * 1e6) for name, xs in zip(UCX_TRACE_STEPS, steps, strict=True)
    ]
    return rows, statistics.median(half) * 1e6
