"""The demo's driver: prepares the model, starts the WAN emulator and the
three role processes, replays closed-loop agent sessions once per pipeline,
seed and load point, plays the client (merges each request's token stream),
checks every stream against the reference engine decoding it alone, and
reports.

Pipelines:
  baseline  cross-datacenter, all prompt KV crosses the WAN; the main decode waits for it
  same_dc   everything on the fast path (one datacenter): the lower bound
  radix     + the decode-side radix cache and in-flight dedupe: only the missing suffix crosses
  pdd       + the relay decode and the token-ID handoff (the full PDD design),
            the router choosing P-MD or P-RLD-MD per request (P-RLD: the anomalous filter)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.errors import Unavailable
from kvbridge.handoff.messages import Source, StreamTokens, decode
from kvbridge.handoff.params import SamplingParams
from kvbridge.pdd import (
    ClientOpen,
    ClientStream,
    Deliver,
    Finish,
    PddConfig,
    PddCore,
    Role,
    StreamDone,
)

from ..sim.trace import generate_agent_trace
from .config import PAPER, DemoConfig
from .control import ControlClient
from .lifecycle import (
    cancel_on_signal,
    child_env,
    start_janitor,
    stop_janitor,
    stop_processes,
)
from .prompts import PromptBuilder
from .report import (
    Aggregate,
    PipelineSummary,
    RequestRecord,
    aggregate,
    format_tables,
    percentile,
    summarize,
    write_outputs,
)
from .roles import params_to

__all__ = ["DemoResult", "RoleProcesses", "Session", "Turn", "build_sessions", "run_demo"]

PIPELINE_TITLES = {
    "baseline": "cross-DC baseline (all KV)",
    "same_dc": "same-DC baseline (fast path)",
    "radix": "+ radix cache, dedupe",
    "pdd": "+ relay, token-ID handoff",
}


REF_STRIDE = 100_000  # reference stream ids: seed * REF_STRIDE + the turn's index


@dataclass(frozen=True)
class Turn:
    index: int  # within the seed's trace
    session: int
    turn: int
    prompt: tuple[int, ...]
    params: SamplingParams
    tool_s: float  # after the answer, before the next turn


@dataclass(frozen=True)
class Session:
    index: int
    start_s: float
    turns: tuple[Turn, ...]


def build_sessions(cfg: DemoConfig, seed: int, builder: PromptBuilder) -> list[Session]:
    """The seed's agent trace as closed-loop sessions (at most ``cfg.turns`` turns each)."""
    trace = generate_agent_trace(cfg.trace_config(seed))
    by: dict[str, list[Any]] = defaultdict(list)
    for r in trace.requests:
        by[r.session_id].append(r)
    sessions: list[Session] = []
    idx = 0
    lo, hi = cfg.output_tokens
    for s, (sid, reqs) in enumerate(sorted(by.items(), key=lambda kv: kv[1][0].arrival_s)):
        turns = []
        for k, r in enumerate(reqs[: cfg.turns]):
            h = hashlib.blake2b(f"{seed}/{sid}/{k}".encode(), digest_size=8).digest()
            rng = random.Random(int.from_bytes(h, "little"))
            params = SamplingParams(
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                seed=int.from_bytes(h, "little"),
                max_new_tokens=min(max(r.output_tokens, lo), hi),
            )
            prompt = tuple(builder.tokens(r))
            turns.append(Turn(idx, s, k, prompt, params, rng.expovariate(1.0 / cfg.tool_s)))
            idx += 1
        sessions.append(Session(s, reqs[0].arrival_s - trace.requests[0].arrival_s, tuple(turns)))
    return sessions


def system_prompts(cfg: DemoConfig, seed: int, builder: PromptBuilder) -> list[list[int]]:
    """The seed's system prompts (every session starts with one of them)."""
    trace = generate_agent_trace(cfg.trace_config(seed))
    seen: dict[tuple[int, int], list[int]] = {}
    for r in trace.requests:
        seg = r.segments[0]
        key = (getattr(seg, "seed", 0), seg.length)
        if key not in seen:
            seen[key] = builder.tokens(type(r)(r.request_id, r.session_id, 0, 1, (seg,)))
    return list(seen.values())


async def _warm_md(
    cfg: DemoConfig, p: ControlClient, client: _Client, prompts: list[list[int]], rid0: int
) -> None:
    """The main decode of a long-running deployment holds the system prompts:
    send each once through the radix pipeline (one output token), unmeasured;
    all at once (they share nothing)."""

    async def one(rid: int, prompt: list[int]) -> None:
        client.open(RequestRecord(rid, -1, "warm", "", len(prompt), 0, 0, time.monotonic()))
        params = SamplingParams(temperature=0.0, max_new_tokens=1)
        try:
            await p.call(
                "request",
                timeout=cfg.request_timeout_s,
                rid=rid,
                prompt=prompt,
                params=params_to(params),
                pipeline="radix",
            )
            await asyncio.wait_for(client.done[rid].wait(), cfg.request_timeout_s)
        finally:
            client.close(rid)

    await asyncio.gather(*(one(rid0 + i, prompt) for i, prompt in enumerate(prompts)))


@dataclass
class DemoResult:
    config: DemoConfig
    wan_mode: str
    wan_note: str
    summaries: list[PipelineSummary]
    aggregates: list[Aggregate]
    records: dict[str, list[RequestRecord]]
    ideal_p_hit: float = 0.0
    paths: dict[str, Path] = field(default_factory=dict)
    cpu: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # per replay

    @property
    def ok(self) -> bool:
        return all(s.completed == s.requests and s.wrong == 0 for s in self.summaries)

    def ratios(self) -> dict[str, float]:
        """The targets' figures per load point (means over seeds of per-seed values)."""
        out: dict[str, float] = {}
        for load in sorted({s.load for s in self.summaries}):
            by = {(s.name, s.seed): s for s in self.summaries if s.load == load}
            seeds = sorted({seed for _, seed in by})
            tag = f"@{load:g}x"

            def mean(vals: list[float]) -> float:
                vals = [v for v in vals if math.isfinite(v)]
                return sum(vals) / len(vals) if vals else math.nan

            pairs = [
                (by[("baseline", k)], by[("pdd", k)])
                for k in seeds
                if ("baseline", k) in by and ("pdd", k) in by
            ]
            if pairs:
                for q in ("p50", "p90", "p99"):
                    vals = [getattr(p, f"ttft_{q}") / getattr(b, f"ttft_{q}") for b, p in pairs]
                    out[f"ttft_{q}_pdd_vs_baseline{tag}"] = mean(vals)
                    out[f"ttft_{q}_pdd_vs_baseline_max{tag}"] = max(vals)
                out[f"wan_load_baseline{tag}"] = mean([b.wan_load for b, _ in pairs])
            pdd = [s for (n, _), s in by.items() if n == "pdd"]
            if pdd:
                out[f"relay_share{tag}"] = mean([s.relay_share for s in pdd])
                out[f"md_hit{tag}"] = mean([s.md_hit for s in pdd])
                out[f"p_hit{tag}"] = mean([s.p_hit for s in pdd])
                out[f"relay_first_p50_s{tag}"] = mean([s.relay_first_p50 for s in pdd])
                out[f"relay_first_max_s{tag}"] = max(
                    (s.relay_first_max for s in pdd if math.isfinite(s.relay_first_max)),
                    default=math.nan,
                )
                out[f"finished_on_relay_by_failure{tag}"] = float(sum(s.kept for s in pdd))
                out[f"filtered_p_rld{tag}"] = float(sum(s.filtered for s in pdd))
            for name in ("radix", "pdd"):
                sv = [
                    (by[("baseline", k)], by[(name, k)])
                    for k in seeds
                    if ("baseline", k) in by and (name, k) in by
                ]
                if sv:
                    out[f"wan_saving_{name}{tag}"] = mean(
                        [b.wan_bytes / max(1, s.wan_bytes) for b, s in sv]
                    )
        return out


class _Client:
    """The user: the PDD core's exactly-once merge of each request's stream
    from whichever decode sends it."""

    def __init__(self) -> None:
        self.core = PddCore(PddConfig(gap_timeout=30.0, idle_timeout=60.0))
        self.records: dict[int, RequestRecord] = {}
        self.done: dict[int, asyncio.Event] = {}
        self.early: dict[int, list[StreamTokens]] = {}
        self.md_stats: dict[int, dict[str, Any]] = {}
        self.rld_stats: dict[int, dict[str, Any]] = {}

    def open(self, rec: RequestRecord) -> None:
        self.records[rec.request_id] = rec
        self.core.handle(ClientOpen(rec.request_id, time.monotonic()))
        self.done[rec.request_id] = asyncio.Event()
        for msg in self.early.pop(rec.request_id, []):
            self._push(msg)

    def close(self, rid: int) -> None:
        self.core.handle(Finish(rid, time.monotonic(), Role.CLIENT))
        self.records.pop(rid, None)
        self.done.pop(rid, None)
        self.md_stats.pop(rid, None)
        self.rld_stats.pop(rid, None)

    def on_event(self, ev: dict[str, Any]) -> None:
        op = ev.get("op")
        if op == "stream":
            msg = decode(bytes.fromhex(ev["p"]), int(ev["t"]))
            if isinstance(msg, StreamTokens):
                if msg.request_id in self.records:
                    self._push(msg)
                else:
                    self.early.setdefault(msg.request_id, []).append(msg)
        elif op == "md_done":
            self.md_stats[int(ev["rid"])] = ev
        elif op == "rld_done":
            self.rld_stats[int(ev["rid"])] = ev

    def _push(self, msg: StreamTokens) -> None:
        rid = msg.request_id
        rec = self.records[rid]
        now = time.monotonic()
        for c in self.core.handle(ClientStream(msg, now)):
            if isinstance(c, Deliver):
                rec.tokens.extend(c.tokens)
                rec.arrivals.extend([now] * len(c.tokens))
                rec.sources += ("R" if c.source is Source.RELAY else "M") * len(c.tokens)
                if c.source is Source.RELAY:
                    rec.relay_tokens += len(c.tokens)
            elif isinstance(c, StreamDone):
                self.done[rid].set()


def _check(got: list[int], ref: tuple[list[int], list[float]]) -> tuple[str, Any]:
    """ "exact", or "verify" (differs: teacher-forced at the end), or "WRONG"
    (another length: the stream lost or repeated tokens)."""
    want, margins = ref
    if got == want:
        return "exact", None
    if len(got) != len(want):
        return "WRONG", {"length": len(got), "want": len(want)}
    i = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    return "verify", {"at": i, "margin": margins[i]}


async def _replay(
    name: str,
    cfg: DemoConfig,
    sessions: list[Session],
    load: float,
    p: ControlClient,
    client: _Client,
    refs: dict[int, tuple[list[int], list[float]]],
    rid_base: int,
    bpt: int,
    bar: Any,
) -> tuple[list[RequestRecord], float]:
    t0 = time.monotonic()
    records: list[RequestRecord] = []

    async def one(turn: Turn) -> RequestRecord:
        rid = rid_base + turn.index
        rec = RequestRecord(
            rid, turn.session, "?", "", len(turn.prompt), 0, 0, time.monotonic(),
            full_kv_bytes=len(turn.prompt) * bpt,
        )  # fmt: skip
        client.open(rec)
        try:
            rep = await p.call(
                "request",
                timeout=cfg.request_timeout_s + 10,
                rid=rid,
                prompt=list(turn.prompt),
                params=params_to(turn.params),
            )
            rec.pipeline, rec.reason = rep["pipeline"], rep["reason"]
            rec.matched_tokens = int(rep["matched"])
            rec.p_hit_tokens = int(rep["p_hit"])
            rec.prefill_end_t = float(rep["prefill_end_t"])
            rec.wan_bytes = int(rep.get("md_wire_bytes", 0))
            rec.detail["p"] = rep
            for k in ("md_error", "rld_error"):
                if k in rep:
                    rec.error = rep[k]
            await asyncio.wait_for(client.done[rid].wait(), cfg.request_timeout_s)
        except Exception as e:
            rec.error = rec.error or f"{type(e).__name__}: {e}"
        uses_md = rec.pipeline in ("P-MD", "P-RLD-MD")
        uses_rld = rec.pipeline in ("P-RLD-MD", "P-RLD", "P-D")
        for _ in range(60):  # the roles' reports trail the last token slightly
            if (not uses_md or rid in client.md_stats) and (
                not uses_rld or rid in client.rld_stats
            ):
                break
            await asyncio.sleep(0.05)
        md = client.md_stats.get(rid, {}) if uses_md else {}
        rld = client.rld_stats.get(rid, {})
        rec.detail.update(md=md, rld=rld)
        for role in (md, rld):
            if role.get("error") and not rec.error and not (role is md and rld.get("kept")):
                rec.error = f"{'md' if role is md else 'rld'}: {role['error']}"
        rec.kept = bool(rld.get("kept"))
        if md.get("switch_at") is not None and rec.relay_tokens:
            rec.switch_at = int(md["switch_at"])
        if not rec.error:
            rec.check, why = _check(rec.tokens, refs[turn.index])
            if why is not None:
                rec.detail["check"] = why
        client.close(rid)
        if bar is not None:
            bar.update(1)
        return rec

    async def session(s: Session) -> None:
        await asyncio.sleep(max(0.0, t0 + s.start_s / load - time.monotonic()))
        for turn in s.turns:
            records.append(await one(turn))
            await asyncio.sleep(turn.tool_s / load)

    await asyncio.gather(*(session(s) for s in sessions))
    records.sort(key=lambda r: r.request_id)
    return records, time.monotonic() - t0


class RoleProcesses:
    """The three role processes (and, in netns mode, the WAN emulator they
    run in).  Each role exits when this process dies, even by SIGKILL
    (``PR_SET_PDEATHSIG``); a janitor process deletes the emulator's
    namespaces when this process is gone (:mod:`kvbridge_bench.demo.lifecycle`)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.emu: Any = None
        self.janitor: subprocess.Popen[bytes] | None = None

    def start(self, cfg: DemoConfig, mode: str, cfg_path: str, socks: dict[str, str]) -> None:
        from ..sim.emulator import WanEmulator

        env = child_env()
        env.setdefault("UCX_TLS", "tcp,self,sm")
        env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        argv = [sys.executable, "-m", "kvbridge_bench.demo.roles"]
        if mode == "netns":
            WanEmulator.cleanup_stale()  # a demo killed by SIGKILL before its janitor ran
            self.emu = emu = WanEmulator(
                rate_bps=cfg.wan_rate_bps, rtt_ms=cfg.wan_rtt_ms, loss=cfg.wan_loss
            )
            emu.start()
            self.janitor = start_janitor([emu.namespace("a"), emu.namespace("b")])
            hosts = {"p": emu.addr("a"), "rld": "127.0.0.1", "md": emu.addr("b")}
            sides = {"p": "a", "rld": "a", "md": "b"}
            for r in ("md", "rld", "p"):
                self.procs.append(
                    emu.popen(sides[r], [*argv, r, cfg_path, socks[r], hosts[r]], env=env)
                )
        else:
            for r in ("md", "rld", "p"):
                self.procs.append(
                    subprocess.Popen([*argv, r, cfg_path, socks[r], "127.0.0.1"], env=env)
                )

    def close(self) -> None:
        """Stop the roles (SIGTERM, then SIGKILL; bounded), then the emulator."""
        try:
            stop_processes(self.procs, grace_s=5.0)
        finally:
            if self.emu is not None:
                self.emu.close()
            if self.janitor is not None:
                stop_janitor(self.janitor)


async def _role_stats(clients: dict[str, ControlClient]) -> dict[str, dict[str, Any]]:
    return {r: await c.call("stats", timeout=10.0) for r, c in clients.items()}


def cpu_use(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], wall_s: float
) -> dict[str, dict[str, float]]:
    """Per role over one replay, in cores: ``cpu`` (the process's CPU time),
    ``engine`` (its worker's compute time) and ``passes``."""
    out: dict[str, dict[str, float]] = {}
    w = max(wall_s, 1e-9)
    for r in after:
        a, b = after[r], before.get(r, {})
        aw, bw = a.get("worker", {}), b.get("worker", {})
        out[r] = {
            "cpu": (a.get("cpu_s", 0.0) - b.get("cpu_s", 0.0)) / w,
            "engine": (aw.get("busy_s", 0.0) - bw.get("busy_s", 0.0)) / w,
            "passes": float(aw.get("passes", 0) - bw.get("passes", 0)),
        }
    return out


def cfg_tie(cfg: DemoConfig) -> float:
    """The largest score deficit (see engines.verify_streams) that counts as
    rounding: bf16 matmuls batched differently differ in their last bits."""
    return 0.5 if cfg.kv_dtype == "bf16" or cfg.model != "random" else 1e-3


def _wan_mode(cfg: DemoConfig) -> tuple[str, str]:
    from ..sim.emulator import WanEmulator

    ok, reason = WanEmulator.available()
    if cfg.wan_mode == "netns" and not ok:
        raise Unavailable(f"packet-level WAN emulator unavailable: {reason}")
    if cfg.wan_mode == "proxy" or (cfg.wan_mode == "auto" and not ok):
        note = "proxy mode (TCP-terminating; less faithful)"
        if not ok:
            note += f": packet-level emulator unavailable ({reason})"
        return "proxy", note
    return "netns", "packet-level (network namespaces + TUN forwarder)"


def _bar(total: int, desc: str, progress: bool) -> Any:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)


async def run_demo(
    cfg: DemoConfig, out_dir: Path | None = None, *, progress: bool = True, log: Any = print
) -> DemoResult:
    """The whole demo; SIGTERM / SIGINT cancel it, and it stops every
    process and namespace it started before it returns or raises."""
    with cancel_on_signal():  # SIGTERM / SIGINT: the finally below still runs
        return await _run_demo(cfg, out_dir, progress=progress, log=log)


async def _run_demo(
    cfg: DemoConfig, out_dir: Path | None, *, progress: bool, log: Any
) -> DemoResult:
    from ..reference.model_file import default_cache_dir
    from ..sim.emulator import ProxyEmulator
    from .engines import cached_reference_streams, verify_streams

    t_start = time.monotonic()
    tokenizer = None
    if cfg.model != "random":
        from ..reference.model_file import TextCodec, prepare_model

        model_dir = prepare_model(log=log)
        cfg = cfg.replace(model_dir=str(model_dir))
        tokenizer = TextCodec(model_dir / "tokenizer.json")
    builder = PromptBuilder(tokenizer, cfg.decoder_config().vocab_size)
    mode, note = _wan_mode(cfg)
    seeds = {seed: build_sessions(cfg, seed, builder) for seed in cfg.seeds}
    bpt = cfg.p_layout().bytes_per_token
    n_req = sum(len(s.turns) for ss in seeds.values() for s in ss)
    log(
        f"kvbridge demo: {'SmolLM2-135M-Instruct (bf16)' if tokenizer else 'random model'}, "
        f"KV {bpt} B/token; {len(cfg.seeds)} seeds x {len(cfg.loads)} load points, "
        f"{n_req // max(1, len(cfg.seeds))} requests per replay; WAN "
        f"{cfg.wan_rate_bps / 1e6:.0f} Mbit/s, RTT {cfg.wan_rtt_ms:.0f} ms, {note}; "
        f"P->RLD over {cfg.rld_transport}"
    )
    tmp = tempfile.mkdtemp(prefix="kvb-demo-")
    cfg_path = os.path.join(tmp, "config.json")
    Path(cfg_path).write_text(cfg.to_json())
    socks = {r: os.path.join(tmp, f"{r}.sock") for r in ("p", "rld", "md")}
    clients: dict[str, ControlClient] = {}
    client = _Client()
    roles = RoleProcesses()
    proxy: Any = None
    summaries: list[PipelineSummary] = []
    records: dict[str, list[RequestRecord]] = {}
    cpu: dict[str, dict[str, dict[str, float]]] = {}  # per replay and role, in cores
    try:
        roles.start(cfg, mode, cfg_path, socks)
        # what the reference engine outputs for each request by itself, while
        # the roles start (computed once per trace and model, then read from
        # the cache; on a thread, so that SIGTERM / SIGINT are served meanwhile)
        import torch

        torch.set_num_threads(1)
        cache = None if cfg.model == "random" else default_cache_dir() / "demo"
        stop_refs = threading.Event()
        # every seed's requests in one batch: one decode step serves them all (one
        # torch thread: intra-op threads on a busy machine are slower, not faster)
        reqs = [
            (seed * REF_STRIDE + t.index, t.prompt, t.params)
            for seed, sessions in seeds.items()
            for sess in sessions
            for t in sess.turns
        ]
        try:
            streams, hit = await asyncio.to_thread(
                cached_reference_streams, cfg, reqs, cache, stop=stop_refs
            )
        finally:
            stop_refs.set()
        refs: dict[int, dict[int, tuple[list[int], list[float]]]] = defaultdict(dict)
        for rid, stream in streams.items():
            refs[rid // REF_STRIDE][rid % REF_STRIDE] = stream
        log(
            f"reference streams: {n_req} requests in {time.monotonic() - t_start:.0f} s"
            + (f" (from {cache})" if hit else "")
        )

        for r in ("md", "rld", "p"):
            clients[r] = ControlClient(socks[r], on_event=client.on_event)
            await clients[r].connect(timeout=180.0)
            await clients[r].call("ping", timeout=60.0)
        md_info = await clients["md"].call("info")
        md_addr = (md_info["host"], int(md_info["port"]))
        if mode == "proxy":
            proxy = ProxyEmulator(md_addr, rate_bps=cfg.wan_rate_bps, rtt_ms=cfg.wan_rtt_ms)
            await proxy.__aenter__()
            md_addr = proxy.listen_addr[:2]
        rld_info = await clients["rld"].call("info")
        await clients["rld"].call("connect", host=md_addr[0], port=md_addr[1])
        await clients["p"].call(
            "connect",
            md_host=md_addr[0],
            md_port=md_addr[1],
            rld_ucx=rld_info.get("ucx", ""),
            rld_host=rld_info.get("host", ""),
            rld_port=rld_info.get("port", 0),
            rld_sock=socks["rld"],
        )
        log(f"roles up after {time.monotonic() - t_start:.0f} s: main decode {md_info['layout']}")
        # the pipelines take turns going first (seed by seed), so that a slow
        # start or a drift of the machine does not favour one of them
        plan: list[tuple[int, float, str]] = []
        for si, seed in enumerate(cfg.seeds):
            for li, load in enumerate(cfg.loads):
                names = list(cfg.pipelines if li == 0 else cfg.high_load_pipelines)
                rot = si % len(names)
                plan += [(seed, load, name) for name in names[rot:] + names[:rot]]
        bar = _bar(len(plan), "replays", progress)
        warm_seed: int | None = None
        for k, (seed, load, name) in enumerate(plan):
            sysp = system_prompts(cfg, seed, builder)
            if warm_seed != seed:  # the prefill has computed the seed's system prompts
                await clients["p"].call("warm", prompts=sysp, timeout=300.0)
                warm_seed = seed
            await clients["md"].call("configure")
            await clients["p"].call("configure", pipeline=name)
            if name in ("radix", "pdd"):
                await _warm_md(cfg, clients["p"], client, sysp, (k + 1) * 100000 + 90000)
            before = await _role_stats(clients)
            recs, wall = await _replay(
                name,
                cfg,
                seeds[seed],
                load,
                clients["p"],
                client,
                refs[seed],
                (k + 1) * 100000,
                bpt,
                None,
            )
            records[f"{name}@{load:g}x/seed{seed}"] = recs
            cpu[f"{name}@{load:g}x/seed{seed}"] = cpu_use(before, await _role_stats(clients), wall)
            s = summarize(
                name, recs, wall, load=load, seed=seed, sla_s=cfg.ttft_sla_s,
                line_bps=cfg.wan_rate_bps,
            )  # fmt: skip
            summaries.append(s)
            if bar is not None:
                bar.update(1)
            use = cpu[f"{name}@{load:g}x/seed{seed}"]
            log(
                f"  seed {seed} load {load:g}x {name}: {s.completed}/{s.requests} done, TTFT p90 "
                f"{s.ttft_p90 * 1e3:.0f} ms, relay {100 * s.relay_share:.1f}%, {wall:.1f} s; "
                "CPU (cores) " + ", ".join(f"{r} {u['cpu']:.2f}" for r, u in use.items())
            )
        if bar is not None:
            bar.close()
    finally:
        # every step bounded: the roles stop (asked, then SIGTERM, then SIGKILL),
        # then the forwarder and the namespaces go
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(
                asyncio.gather(
                    *(c.call("shutdown", timeout=3.0) for c in clients.values()),
                    return_exceptions=True,
                ),
                4.0,
            )
        for c in clients.values():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(c.close(), 2.0)
        if proxy is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(proxy.__aexit__(None, None, None), 5.0)
        roles.close()
        for path in socks.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(tmp, ignore_errors=True)
    # streams that differ from the reference: teacher-forced through it (no
    # role runs any more, so this takes the whole machine)
    by_seed = {sd: {t.index: t for ss_ in ss for t in ss_.turns} for sd, ss in seeds.items()}
    todo = [(rec, key) for key, recs in records.items() for rec in recs if rec.check == "verify"]
    if todo:
        # the same turn decoded to the same tokens by several pipelines is
        # teacher-forced once (the check depends only on prompt, sampling and output)
        items = []
        first: dict[tuple[int, int, tuple[int, ...]], int] = {}
        same: list[int] = []  # per todo entry: the request id whose check it shares
        for rec, key in todo:
            sd = int(key.rsplit("seed", 1)[1])
            t = by_seed[sd][rec.request_id % 100000]
            turn = (sd, rec.request_id % 100000, tuple(rec.tokens))
            if turn not in first:
                first[turn] = rec.request_id
                items.append((rec.request_id, t.prompt, t.params, rec.tokens))
            same.append(first[turn])
        t_verify = time.monotonic()
        deficits = verify_streams(cfg, items)
        log(
            f"{len(todo)} streams ({len(items)} distinct) teacher-forced in "
            f"{time.monotonic() - t_verify:.0f} s"
        )
        for (rec, _), rid in zip(todo, same, strict=True):
            d = deficits[rid]
            rec.detail.setdefault("check", {})["deficit"] = d
            rec.check = "near-tie" if d <= cfg_tie(cfg) else "WRONG"
        summaries = [_resummarize(cfg, s, records) for s in summaries]
    aggs = aggregate(summaries)
    result = DemoResult(cfg, mode, note, summaries, aggs, records, cpu=cpu)
    ratios = result.ratios()
    if out_dir is not None:
        result.paths = write_outputs(
            out_dir,
            summaries,
            records,
            {
                "config": {k: v for k, v in cfg.__dict__.items() if not k.startswith("_")},
                "wan_mode": mode,
                "wan_note": note,
                "ratios": ratios,
                "scaling": scaling(cfg, summaries, seeds),
                "cpu": cpu,
            },
            PIPELINE_TITLES,
        )
    log("")
    log(format_tables(aggs, PIPELINE_TITLES))
    for line in report_lines(cfg, result, ratios, seeds, tokenizer):
        log(line)
    log(f"demo took {time.monotonic() - t_start:.0f} s")
    return result


def _resummarize(
    cfg: DemoConfig, s: PipelineSummary, records: dict[str, list[RequestRecord]]
) -> PipelineSummary:
    recs = records[f"{s.name}@{s.load:g}x/seed{s.seed}"]
    return summarize(
        s.name, recs, s.wall_s, load=s.load, seed=s.seed, sla_s=cfg.ttft_sla_s,
        line_bps=cfg.wan_rate_bps,
    )  # fmt: skip


def scaling(
    cfg: DemoConfig, summaries: list[PipelineSummary], seeds: dict[int, list[Session]]
) -> dict[str, float]:
    """The demo's scenario against the paper's (see config.PAPER)."""
    turns = [t for ss in seeds.values() for s in ss for t in s.turns]
    avg_in = sum(len(t.prompt) for t in turns) / max(1, len(turns))
    avg_out = sum(t.params.max_new_tokens for t in turns) / max(1, len(turns))
    bpt = cfg.p_layout().bytes_per_token
    tbts = [s.tbt_p50 for s in summaries if s.name == "pdd" and math.isfinite(s.tbt_p50)]
    tbt = sum(tbts) / len(tbts) if tbts else cfg.relay_step_prior_s
    demo_ratio = (avg_in * bpt * 8 / cfg.wan_rate_bps) / (avg_out * tbt)
    paper_full = PAPER.input_tokens * PAPER.kv_bytes_per_token * 8
    paper_decode = PAPER.output_tokens * PAPER.decode_step_s
    lo, hi = PAPER.wan_gbps
    return {
        "avg_input_tokens": avg_in,
        "avg_output_tokens": avg_out,
        "input_scale": avg_in / PAPER.input_tokens,
        "output_scale": avg_out / PAPER.output_tokens,
        "kv_bytes_per_token": bpt,
        "wan_mbps": cfg.wan_rate_bps / 1e6,
        "decode_step_s": tbt,
        "transfer_over_decode": demo_ratio,
        "paper_transfer_over_decode_at_low": paper_full / (lo * 1e9) / paper_decode,
        "paper_transfer_over_decode_at_high": paper_full / (hi * 1e9) / paper_decode,
        "paper_equivalent_gbps": paper_full / paper_decode / demo_ratio / 1e9,
    }


def report_lines(
    cfg: DemoConfig,
    result: DemoResult,
    ratios: dict[str, float],
    seeds: dict[int, list[Session]],
    tokenizer: Any,
) -> list[str]:
    sc = scaling(cfg, result.summaries, seeds)
    out = [
        "scaling of the paper's scenario (64K-token prompts at ~90% hit, 1K-token outputs, "
        "~50 KB/token, 10-100 Gbit/s; a 20 ms decode step assumed):",
        f"  prompts {sc['avg_input_tokens']:.0f} tokens on average (x{sc['input_scale']:.4f}), "
        f"outputs {sc['avg_output_tokens']:.0f} (x{sc['output_scale']:.3f}), "
        f"{sc['kv_bytes_per_token']} B of KV per token, WAN {sc['wan_mbps']:.0f} Mbit/s, "
        f"decode step {sc['decode_step_s'] * 1e3:.0f} ms",
        f"  a whole prompt's KV transfer / an output's decode time: {sc['transfer_over_decode']:.3f}"
        f" (paper: {sc['paper_transfer_over_decode_at_low']:.3f} at 10 Gbit/s, "
        f"{sc['paper_transfer_over_decode_at_high']:.4f} at 100 Gbit/s; the demo is the paper "
        f"at {sc['paper_equivalent_gbps']:.1f} Gbit/s)",
    ]
    for load in sorted({s.load for s in result.summaries}):
        t = f"@{load:g}x"
        if f"ttft_p90_pdd_vs_baseline{t}" not in ratios:
            continue
        out.append(
            f"load {load:g}x: full pipeline vs cross-DC baseline TTFT p50 / p90 / p99 "
            f"{ratios[f'ttft_p50_pdd_vs_baseline{t}']:.2f}x / "
            f"{ratios[f'ttft_p90_pdd_vs_baseline{t}']:.2f}x / "
            f"{ratios[f'ttft_p99_pdd_vs_baseline{t}']:.2f}x "
            f"(worst seed {ratios[f'ttft_p90_pdd_vs_baseline_max{t}']:.2f}x / "
            f"{ratios[f'ttft_p99_pdd_vs_baseline_max{t}']:.2f}x); baseline WAN load "
            f"{ratios[f'wan_load_baseline{t}']:.2f} of the line rate"
        )
        out.append(
            f"  relay share {100 * ratios.get(f'relay_share{t}', math.nan):.1f}% of output "
            f"tokens; finished on the relay by failure: "
            f"{ratios.get(f'finished_on_relay_by_failure{t}', 0):.0f}, by the anomalous filter "
            f"(P-RLD): {ratios.get(f'filtered_p_rld{t}', 0):.0f}; hit rate main decode "
            f"{100 * ratios.get(f'md_hit{t}', math.nan):.1f}% vs prefill side "
            f"{100 * ratios.get(f'p_hit{t}', math.nan):.1f}%; WAN saving of the decode cache "
            + ", ".join(
                f"{n} {ratios[f'wan_saving_{n}{t}']:.1f}x"
                for n in ("radix", "pdd")
                if f"wan_saving_{n}{t}" in ratios
            )
        )
        puts = [
            r.detail["rld"]["kv_t"] - r.prefill_end_t
            for k, recs in result.records.items()
            if k.startswith("pdd@") and f"@{load:g}x/" in k
            for r in recs
            if r.relayed and r.prefill_end_t is not None and "kv_t" in r.detail.get("rld", {})
        ]
        out.append(
            f"  relay's first token after its prefill ended: p50 "
            f"{1e3 * ratios.get(f'relay_first_p50_s{t}', math.nan):.0f} ms, max "
            f"{1e3 * ratios.get(f'relay_first_max_s{t}', math.nan):.0f} ms (of which the "
            f"prompt KV's put to the relay: p50 {1e3 * percentile(puts, 50):.0f} ms, max "
            f"{1e3 * max(puts, default=math.nan):.0f} ms; the relay's next token follows "
            f"one decode step later)"
        )
    out += ttft_parts(result)
    out += _one_stream(result, tokenizer)
    return out


def ttft_parts(result: DemoResult) -> list[str]:
    """Where each pipeline's time to first token goes, per load point, from
    the per-request records (p50 / p90 over seeds, ms): the prefix
    negotiation (a WAN round trip), the wait for the prefill's worker, the
    prefill's compute, and the first token after the
    prefill ended (the WAN transfer for P-MD, the put to the relay for
    P-RLD-MD); and each role's CPU use in cores (mean over the replays)."""
    out = ["where the time to first token goes (p50 / p90 over seeds, ms; CPU in cores):"]
    groups: dict[tuple[str, float], list[str]] = defaultdict(list)
    for key in result.records:
        name, rest = key.split("@", 1)
        groups[(name, float(rest.split("x/", 1)[0]))].append(key)
    for (name, load), keys in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        recs = [r for k in keys for r in result.records[k] if r.arrivals and not r.error]
        parts: dict[str, list[float]] = defaultdict(list)
        for r in recs:
            p = r.detail.get("p", {})
            if "negotiate_s" in p:
                parts["negotiate"].append(float(p["negotiate_s"]))
            if "prefill_s" in p and "compute_s" in p:
                parts["queue"].append(float(p["prefill_s"]) - float(p["compute_s"]))
                parts["compute"].append(float(p["compute_s"]))
            if r.prefill_end_t is not None:
                parts["after"].append(r.arrivals[0] - r.prefill_end_t)
            parts["ttft"].append(r.ttft)

        def q(k: str, parts: dict[str, list[float]] = parts) -> str:
            return f"{1e3 * percentile(parts[k], 50):.0f} / {1e3 * percentile(parts[k], 90):.0f}"

        use: dict[str, list[float]] = defaultdict(list)
        for k in keys:
            for role, u in result.cpu.get(k, {}).items():
                use[role].append(u["cpu"])
        cpu = ", ".join(f"{role} {sum(v) / len(v):.2f}" for role, v in sorted(use.items()))
        out.append(
            f"  {name} @{load:g}x: TTFT {q('ttft')}; prefix negotiation {q('negotiate')}, "
            f"prefill queue {q('queue')}, compute {q('compute')}, first token after prefill "
            f"{q('after')}" + (f"; CPU {cpu}" if cpu else "")
        )
    return out


def _one_stream(result: DemoResult, tokenizer: Any) -> list[str]:
    """One relayed request's stream: which tokens came from which decode."""
    for key, recs in result.records.items():
        if not key.startswith("pdd@"):
            continue
        for r in recs:
            if r.relayed and 0 < r.relay_tokens < len(r.tokens) and r.check:
                k = r.sources.rfind("R") + 1
                if tokenizer is None:
                    relay, main = str(r.tokens[:k]), str(r.tokens[k:])
                else:
                    relay, main = tokenizer.decode(r.tokens[:k]), tokenizer.decode(r.tokens[k:])
                return [
                    f"one stream ({key}, request {r.request_id}, {len(r.tokens)} tokens, "
                    f"TTFT {r.ttft * 1e3:.0f} ms, switch gap "
                    f"{(r.switch_gap() or 0) * 1e3:.0f} ms):",
                    f"  relay decode ({k} tokens): {relay!r}",
                    f"  main decode ({len(r.tokens) - k} tokens): {main!r}",
                ]
    return []
