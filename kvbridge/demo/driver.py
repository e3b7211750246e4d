"""The demo's driver: starts the WAN emulator and the three role processes,
replays an agent trace once per pipeline, plays the client (merges each
request's token stream), checks every stream against one decoder decoding
alone, and reports.

Pipelines:
  baseline  all prompt KV crosses the WAN; the main decode waits for it
  radix     + the decode-side radix cache: only the missing suffix crosses
  pdd       + the relay decode and the token-ID handoff (the full PDD design),
            with the router choosing P-MD or P-RLD-MD per request
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Unavailable
from ..handoff.messages import Source, StreamTokens, decode
from ..handoff.params import SamplingParams
from ..handoff.stream import StreamMerge
from ..sim.trace import AgentTraceConfig, generate_agent_trace
from .config import DemoConfig
from .control import ControlClient
from .report import PipelineSummary, RequestRecord, format_table, summarize, write_outputs
from .roles import params_to

__all__ = ["DemoRequest", "DemoResult", "build_requests", "reference_streams", "run_demo"]

PIPELINE_TITLES = {
    "baseline": "1. cross-DC baseline (all KV)",
    "radix": "2. + decode radix cache",
    "pdd": "3. + relay & token-ID handoff (PDD)",
}


@dataclass(frozen=True)
class DemoRequest:
    rid: int
    session: int
    arrival_s: float
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclass
class DemoResult:
    config: DemoConfig
    wan_mode: str
    wan_note: str
    p_hit: float
    summaries: list[PipelineSummary]
    records: dict[str, list[RequestRecord]]
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s.completed == s.requests and s.exact == s.requests for s in self.summaries)

    def ratios(self) -> dict[str, float]:
        by = {s.name: s for s in self.summaries}
        base = by.get(PIPELINE_TITLES["baseline"])
        full = by.get(PIPELINE_TITLES["pdd"])
        radix = by.get(PIPELINE_TITLES["radix"])
        out: dict[str, float] = {}
        if base and full:
            out["ttft_p90_pdd_vs_baseline"] = full.ttft_p90 / base.ttft_p90
            out["ttft_p99_pdd_vs_baseline"] = full.ttft_p99 / base.ttft_p99
            out["ttft_p50_pdd_vs_baseline"] = full.ttft_p50 / base.ttft_p50
        if base and radix and radix.wan_bytes:
            out["wan_bytes_baseline_over_radix"] = base.wan_bytes / radix.wan_bytes
        return out


def build_requests(cfg: DemoConfig) -> list[DemoRequest]:
    """The trace, scaled down for the demo, as concrete requests."""
    trace = generate_agent_trace(
        AgentTraceConfig.demo(seed=cfg.trace_seed, num_sessions=cfg.trace_sessions)
    )
    reqs = sorted(trace.requests, key=lambda r: r.arrival_s)[: cfg.max_requests]
    sessions: dict[str, int] = {}
    out = []
    t0 = reqs[0].arrival_s if reqs else 0.0
    for i, r in enumerate(reqs):
        out_len = min(max(r.output_tokens, cfg.min_new_tokens), cfg.max_new_tokens)
        params = SamplingParams(
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            seed=1000 + i,
            max_new_tokens=out_len,
        )
        prompt = tuple(int(t) for t in r.tokens(cfg.vocab_size))
        out.append(
            DemoRequest(
                rid=i + 1,
                session=sessions.setdefault(r.session_id, len(sessions)),
                arrival_s=(r.arrival_s - t0) * cfg.arrival_scale,
                prompt=prompt,
                params=params,
            )
        )
    return out


def prefill_side_hit(reqs: list[DemoRequest]) -> float:
    """The prefill side's prefix hit rate over the replay: tokens an unbounded,
    token-exact prefix cache of every earlier prompt holds / prompt tokens."""
    from ..sim.ideal_cache import IdealPrefixCache

    cache = IdealPrefixCache()
    hit = sum(cache.match_and_insert(np.asarray(r.prompt, dtype=np.int32)) for r in reqs)
    return hit / max(1, sum(len(r.prompt) for r in reqs))


def reference_streams(
    cfg: DemoConfig, reqs: list[DemoRequest], progress: bool
) -> dict[int, list[int]]:
    """What one decoder decoding each request alone outputs."""
    import torch

    from ..handoff.sampling import sample
    from ..reference.decoder import ReferenceDecoder

    torch.set_num_threads(1)
    lay = cfg.p_layout()
    max_pages = max(lay.pages_for(len(r.prompt) + r.params.max_new_tokens) for r in reqs)
    dec = ReferenceDecoder(cfg.decoder_config(), lay, max_pages + 1)
    out: dict[int, list[int]] = {}
    for r in _bar(reqs, "reference streams", progress):
        dec.allocate(r.rid)
        logits = dec.prefill({r.rid: list(r.prompt)})[r.rid]
        toks = [sample(logits, r.params, 0)]
        while len(toks) < r.params.max_new_tokens and toks[-1] != r.params.eos_token_id:
            logits = dec.decode({r.rid: toks[-1]})[r.rid]
            toks.append(sample(logits, r.params, len(toks)))
        dec.free(r.rid)
        out[r.rid] = toks
    return out


def _bar(items: list[Any], desc: str, progress: bool) -> Any:
    if not progress:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False, file=sys.stderr)


class _Client:
    """The user: merges each request's stream from whichever decode sends it."""

    def __init__(self) -> None:
        self.merges: dict[int, StreamMerge] = {}
        self.records: dict[int, RequestRecord] = {}
        self.done: dict[int, asyncio.Event] = {}
        self.early: dict[int, list[StreamTokens]] = {}
        self.md_stats: dict[int, dict[str, Any]] = {}
        self.rld_stats: dict[int, dict[str, Any]] = {}

    def open(self, rec: RequestRecord) -> None:
        now = time.monotonic()
        self.records[rec.request_id] = rec
        self.merges[rec.request_id] = StreamMerge(
            rec.request_id, gap_timeout=30.0, idle_timeout=60.0, now=now
        )
        self.done[rec.request_id] = asyncio.Event()
        for msg in self.early.pop(rec.request_id, []):
            self._push(msg)

    def on_event(self, ev: dict[str, Any]) -> None:
        op = ev.get("op")
        if op == "stream":
            msg = decode(bytes.fromhex(ev["p"]), int(ev["t"]))
            if isinstance(msg, StreamTokens):
                if msg.request_id in self.merges:
                    self._push(msg)
                else:
                    self.early.setdefault(msg.request_id, []).append(msg)
        elif op == "md_done":
            self.md_stats[int(ev["rid"])] = ev
        elif op == "rld_done":
            self.rld_stats[int(ev["rid"])] = ev

    def _push(self, msg: StreamTokens) -> None:
        rid = msg.request_id
        merge, rec = self.merges[rid], self.records[rid]
        now = time.monotonic()
        new = merge.push(msg, now)
        rec.tokens.extend(new)
        rec.arrivals.extend([now] * len(new))
        if msg.source is Source.RELAY:
            rec.relay_tokens += len(new)
        if merge.done:
            self.done[rid].set()


async def _replay(
    name: str,
    cfg: DemoConfig,
    reqs: list[DemoRequest],
    p: ControlClient,
    client: _Client,
    refs: dict[int, list[int]],
    progress: bool,
    rid_base: int,
) -> tuple[list[RequestRecord], float]:
    t0 = time.monotonic()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc=name, leave=False, file=sys.stderr)

    async def one(r: DemoRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
        rid = rid_base + r.rid
        rec = RequestRecord(rid, r.session, "?", "", len(r.prompt), 0, 0, time.monotonic())
        client.open(rec)
        try:
            rep = await p.call(
                "request",
                timeout=cfg.request_timeout_s + 10,
                rid=rid,
                prompt=list(r.prompt),
                params=params_to(r.params),
            )
            rec.pipeline, rec.reason = rep["pipeline"], rep["reason"]
            rec.matched_tokens = int(rep["matched"])
            rec.wan_bytes = int(rep.get("md_wire_bytes", 0))
            for k in ("md_error", "rld_error"):
                if k in rep:
                    rec.error = rep[k]
            await asyncio.wait_for(client.done[rid].wait(), cfg.request_timeout_s)
        except Exception as e:
            rec.error = rec.error or f"{type(e).__name__}: {e}"
        for _ in range(40):  # the roles' reports trail the last token slightly
            if rid in client.md_stats and (rec.pipeline != "P-RLD-MD" or rid in client.rld_stats):
                break
            await asyncio.sleep(0.05)
        md = client.md_stats.get(rid, {})
        rec.detail = {"md": md, "rld": client.rld_stats.get(rid, {})}
        if md.get("switch_at") is not None and rec.relay_tokens:
            rec.switch_at = int(md["switch_at"])
        rec.exact = not rec.error and rec.tokens == refs[r.rid]
        if bar is not None:
            bar.update(1)
        return rec

    records = await asyncio.gather(*(one(r) for r in reqs))
    if bar is not None:
        bar.close()
    return list(records), time.monotonic() - t0


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


async def run_demo(
    cfg: DemoConfig, out_dir: Path | None = None, *, progress: bool = True, log: Any = print
) -> DemoResult:
    from ..sim.emulator import ProxyEmulator, WanEmulator

    mode, note = _wan_mode(cfg)
    reqs = build_requests(cfg)
    log(
        f"kvbridge demo: {len(reqs)} requests, WAN {cfg.wan_rate_bps / 1e6:.0f} Mbit/s, "
        f"RTT {cfg.wan_rtt_ms:.0f} ms, {note}; P->RLD over {cfg.rld_transport}"
    )
    refs = reference_streams(cfg, reqs, progress)
    tmp = tempfile.mkdtemp(prefix="kvb-demo-")
    cfg_path = os.path.join(tmp, "config.json")
    Path(cfg_path).write_text(cfg.to_json())
    socks = {r: os.path.join(tmp, f"{r}.sock") for r in ("p", "rld", "md")}
    procs: list[subprocess.Popen[bytes]] = []
    clients: dict[str, ControlClient] = {}
    client = _Client()
    emu: Any = None
    proxy: Any = None
    env = dict(os.environ)
    env.setdefault("UCX_TLS", "tcp,self,sm")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    argv = [sys.executable, "-m", "kvbridge.demo.roles"]
    summaries: list[PipelineSummary] = []
    records: dict[str, list[RequestRecord]] = {}
    try:
        if mode == "netns":
            emu = WanEmulator(rate_bps=cfg.wan_rate_bps, rtt_ms=cfg.wan_rtt_ms, loss=cfg.wan_loss)
            emu.start()
            hosts = {"p": emu.addr("a"), "rld": "127.0.0.1", "md": emu.addr("b")}
            sides = {"p": "a", "rld": "a", "md": "b"}
            for r in ("md", "rld", "p"):
                procs.append(emu.popen(sides[r], [*argv, r, cfg_path, socks[r], hosts[r]], env=env))
        else:
            for r in ("md", "rld", "p"):
                procs.append(subprocess.Popen([*argv, r, cfg_path, socks[r], "127.0.0.1"], env=env))
        for r in ("md", "rld", "p"):
            clients[r] = ControlClient(socks[r], on_event=client.on_event)
            await clients[r].connect(timeout=120.0)
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
        log(f"roles up: main decode {md_info['layout']}")
        for k, name in enumerate(cfg.pipelines):
            title = PIPELINE_TITLES[name]
            await clients["md"].call("configure")
            await clients["p"].call("configure", pipeline=name)
            recs, wall = await _replay(
                title, cfg, reqs, clients["p"], client, refs, progress, rid_base=(k + 1) * 100000
            )
            records[name] = recs
            s = summarize(title, recs, wall)
            summaries.append(s)
            log(
                f"{title}: {s.completed}/{s.requests} complete, {s.exact} exact, "
                f"TTFT p50 {s.ttft_p50 * 1e3:.0f} ms, p99 {s.ttft_p99 * 1e3:.0f} ms ({wall:.1f} s)"
            )
    finally:
        for c in clients.values():
            with contextlib.suppress(Exception):
                await c.call("shutdown", timeout=5.0)
            await c.close()
        for pr in procs:
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()
        if proxy is not None:
            await proxy.__aexit__(None, None, None)
        if emu is not None:
            emu.close()
        for path in socks.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    p_hit = prefill_side_hit(reqs)
    result = DemoResult(cfg, mode, note, p_hit, summaries, records)
    if out_dir is not None:
        result.paths = write_outputs(
            out_dir,
            summaries,
            records,
            {
                "config": cfg.__dict__,
                "wan_mode": mode,
                "wan_note": note,
                "prefill_side_hit": p_hit,
                "ratios": result.ratios(),
            },
        )
    log("")
    log(format_table(summaries))
    log(
        f"prefix hit rate: prefill side (ideal cache) {100 * p_hit:.1f}%, main decode "
        + ", ".join(f"{s.name.split(' ', 1)[1]} {100 * s.md_hit:.1f}%" for s in summaries)
    )
    return result
