"""The 100-token handoff microbenchmark: token IDs against the incremental KV.

Payload bytes are computed for real layouts (Llama-3-8B, DeepSeek-V3 MLA) and
measured on the wire (the encoded handoff messages; the packed KV buffer).
Latency is measured over an emulated WAN (one-way delay, jitter, rate,
segment loss with retransmission) for three ways of handing 100 generated
tokens to the main decode:

- incremental KV: pack the 100 tokens' KV of a real layout (torch reference
  of the pack core), send it, unpack it into the main decode's pages, run one
  decode step;
- one-shot token IDs and catch-up token IDs: the real relay and main state
  machines on the reference decoder, from the moment the relay learns that
  the main decode is ready to the main decode's first own token.

The client-visible stall at the switch (the longest gap between two
delivered tokens) is compared between one-shot and catch-up.  Engine steps
are paced to emulate an accelerator (see --decode-ms / --extend-*-ms); the
reference decoder's real CPU time adds to them.  Ratios are against the
incremental KV measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from .output import emit_json

N_TOKENS = 100


@dataclass(frozen=True)
class Wan:
    delay_ms: float
    jitter_ms: float
    gbps: float
    segment_loss: float
    rto_ms: float

    def model(self) -> Any:
        from kvbridge_bench.sim.network import LinkModel

        return LinkModel(
            delay=self.delay_ms / 1e3,
            jitter=self.jitter_ms / 1e3,
            rate_bps=self.gbps * 1e9,
            segment_bytes=64 * 1024,
            segment_loss=self.segment_loss,
            rto=self.rto_ms / 1e3,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=50, help="runs per method (>= 50 for the report)")
    p.add_argument("--model", default="llama-3-8b", help="layout of the incremental KV (not MLA)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="WAN one-way delay")
    p.add_argument("--jitter-ms", type=float, default=3.0, help="WAN jitter (|N(0, j)|)")
    p.add_argument("--gbps", type=float, default=10.0, help="WAN rate")
    p.add_argument("--segment-loss", type=float, default=0.005, help="loss per 64 KiB segment")
    p.add_argument("--rto-ms", type=float, default=200.0, help="retransmission timeout")
    p.add_argument("--decode-ms", type=float, default=4.0, help="emulated decode step")
    p.add_argument("--extend-base-ms", type=float, default=4.0, help="emulated extend, fixed part")
    p.add_argument("--extend-token-ms", type=float, default=0.2, help="emulated extend, per token")
    p.add_argument("--threshold", type=int, default=64, help="catch-up threshold")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per method first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--real-wan",
        metavar="RATE:RTT:LOSS",
        help="also run it over kvbridge's TCP transport through the packet-level "
        "emulator (needs root), e.g. 1gbit:40ms:0.1%%",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")


def payload_table() -> list[dict[str, Any]]:
    from kvbridge.handoff import SamplingParams, Tokens, encode
    from kvbridge.layout import KVLayout

    ids = len(
        encode(Tokens(1, 1, tuple(range(50000, 50000 + N_TOKENS)), SamplingParams(), commit=True))
    )
    rows = []
    for name in ("llama-3-8b", "deepseek-v3"):
        lay = KVLayout.for_model(name)
        kv = lay.wire_nbytes(N_TOKENS)
        rows.append(
            {
                "model": name,
                "layout": lay.describe(),
                "kv_bytes": kv,
                "token_id_bytes": ids,
                "ratio": kv / ids,
            }
        )
    return rows


def _stats(xs: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs]
    return {
        "mean_ms": statistics.fmean(ms),
        "median_ms": statistics.median(ms),
        "max_ms": max(ms),
        "std_ms": statistics.pstdev(ms),
        "runs": len(ms),
    }


async def _kv_runs(args: argparse.Namespace, bar: Any) -> tuple[list[float], int]:
    """Pack, send over the WAN, unpack and decode one step: the incremental KV path."""
    import torch

    from kvbridge.layout import KVLayout
    from kvbridge_bench.reference import DecoderConfig, ReferenceDecoder, gather_wire, scatter_wire
    from kvbridge_bench.sim.network import MemoryNetwork

    lay = KVLayout.for_model(args.model)
    if lay.mla:
        raise SystemExit("--model: the latency runs need a K/V layout (not MLA)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[lay.dtype.value]
    pages = lay.pages_for(N_TOKENS)
    g = torch.Generator().manual_seed(args.seed)
    src = [
        torch.randn(lay.layer_shape(pages), generator=g).to(dtype) for _ in range(lay.num_layers)
    ]
    dst = [torch.empty(lay.layer_shape(pages), dtype=dtype) for _ in range(lay.num_layers)]
    table = list(range(pages))
    cfg = DecoderConfig()
    dec = ReferenceDecoder(cfg, cfg.kv_layout(), 16)
    dec.allocate(1)
    dec.prefill({1: list(range(20))})
    net = MemoryNetwork(seed=args.seed)
    net.set_link(
        "relay",
        "main",
        Wan(args.delay_ms, args.jitter_ms, args.gbps, args.segment_loss, args.rto_ms).model(),
    )
    relay, main = net.node("relay"), net.node("main")
    loop = asyncio.get_running_loop()
    times: list[float] = []
    wire_bytes = 0
    for i in range(args.warmup + args.runs):
        t0 = loop.time()
        wire = gather_wire(lay, src, table, 0, N_TOKENS)
        payload = wire.contiguous().view(torch.uint8).numpy().tobytes()
        await relay.send("main", 0x10, payload)
        gram = await main.recv(30.0)
        assert gram is not None
        got = (
            torch.frombuffer(bytearray(gram.payload), dtype=torch.uint8)
            .view(dtype)
            .view(wire.shape)
        )
        scatter_wire(lay, dst, table, 0, got)
        dec.decode({1: 1})
        wire_bytes = len(gram.payload)
        if i >= args.warmup:
            times.append(loop.time() - t0)
            bar.update(1)
    net.close()
    return times, wire_bytes


async def _token_runs(args: argparse.Namespace, mode: str, bar: Any) -> dict[str, Any]:
    from kvbridge.handoff import HandoffPolicy, HandoffTimeouts, Mode, SamplingParams
    from kvbridge.handoff.driver import Pace
    from kvbridge.pdd import RelayBudget
    from kvbridge_bench.reference import DecoderConfig, ReferenceDecoder
    from kvbridge_bench.sim.handoff_scenario import Scenario, run_scenario
    from kvbridge_bench.sim.network import LinkModel

    cfg = DecoderConfig()
    p = ReferenceDecoder(cfg, cfg.kv_layout(page_tokens=16), 64)
    r = ReferenceDecoder(cfg, cfg.kv_layout(page_tokens=16), 64)
    m = ReferenceDecoder(cfg, cfg.kv_layout(page_tokens=16), 64)
    wan = Wan(args.delay_ms, args.jitter_ms, args.gbps, args.segment_loss, args.rto_ms).model()
    pace = Pace(args.decode_ms / 1e3, args.extend_base_ms / 1e3, args.extend_token_ms / 1e3)
    policy = HandoffPolicy(threshold=args.threshold, max_rounds=8, force=Mode(mode))
    timeouts = HandoffTimeouts(ack_timeout=2.0, ack_per_token=0.01, relay_timeout=20.0)
    lat, stalls, handed, peer_bytes, rounds, median_gap = [], [], [], [], [], []
    for i in range(args.warmup + args.runs):
        sc = Scenario(
            prompt=tuple(range(1, 33)),
            params=SamplingParams(max_new_tokens=N_TOKENS + 40),
            policy=policy,
            budget=RelayBudget(token_budget=4096),
            timeouts=timeouts,
            request_id=i + 1,
            handoff_after=N_TOKENS - int(args.delay_ms / max(args.decode_ms, 1e-3)),
            main_kv_delay=0.0,
            peer_link=wan,
            client_link=LinkModel(),
            relay_pace=pace,
            main_pace=pace,
            seed=args.seed + i,
        )
        res = await run_scenario(sc, p, r, m)
        if (
            res.relay is None
            or res.main is None
            or res.relay.ready_time is None
            or res.main.first_emit_time is None
        ):
            raise SystemExit(f"run {i}: the handoff did not complete: {res.errors}")
        if i < args.warmup:
            continue
        lat.append(res.main.first_emit_time - res.relay.ready_time)
        stalls.append(res.stream.longest_stall())
        arr = res.stream.arrivals
        median_gap.append(statistics.median(b - a for a, b in itertools.pairwise(arr)))
        handed.append(res.relay.gaps[0])
        rounds.append(res.relay.rounds)
        peer_bytes.append(res.peer_bytes)
        bar.update(1)
    return {
        "latency": _stats(lat),
        "stall": _stats(stalls),
        "median_token_gap_ms": statistics.fmean(median_gap) * 1e3,
        "tokens_handed_mean": statistics.fmean(handed),
        "rounds_mean": statistics.fmean(rounds),
        "peer_bytes_mean": statistics.fmean(peer_bytes),
    }


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    total = 3 * args.runs
    with tqdm(
        total=total, desc="handoff", disable=args.no_progress or args.json, file=sys.stderr
    ) as bar:
        kv_times, kv_wire = await _kv_runs(args, bar)
        one = await _token_runs(args, "one_shot", bar)
        cat = await _token_runs(args, "catch_up", bar)
    kv = _stats(kv_times)
    return {
        "payload": payload_table(),
        "wan": vars(Wan(args.delay_ms, args.jitter_ms, args.gbps, args.segment_loss, args.rto_ms)),
        "incremental_kv": {"latency": kv, "wire_bytes": kv_wire, "model": args.model},
        "one_shot": one,
        "catch_up": cat,
        "ratios_vs_kv": {
            name: {k: res["latency"][k] / kv[k] for k in ("mean_ms", "max_ms", "std_ms") if kv[k]}
            for name, res in (("one_shot", one), ("catch_up", cat))
        },
        "stall_catch_up_vs_one_shot": cat["stall"]["mean_ms"] / one["stall"]["mean_ms"],
    }


def _print(r: dict[str, Any]) -> None:
    print(f"{N_TOKENS}-token handoff payload")
    for row in r["payload"]:
        print(
            f"  {row['model']:<12} incremental KV {row['kv_bytes'] / 1024:10.1f} KiB   "
            f"token IDs {row['token_id_bytes']} B   ({row['ratio']:.0f}x)"
        )
    w = r["wan"]
    print(
        f"latency over the emulated WAN ({w['delay_ms']} ms one-way, {w['jitter_ms']} ms jitter, "
        f"{w['gbps']} Gbps, {w['segment_loss']} segment loss, {w['rto_ms']} ms RTO)"
    )
    rows = [
        ("incremental KV", r["incremental_kv"]["latency"]),
        ("one-shot IDs", r["one_shot"]["latency"]),
        ("catch-up IDs", r["catch_up"]["latency"]),
    ]
    print(f"  {'method':<16}{'mean ms':>10}{'median':>10}{'max ms':>10}{'std ms':>10}{'runs':>6}")
    for name, s in rows:
        print(
            f"  {name:<16}{s['mean_ms']:10.1f}{s['median_ms']:10.1f}{s['max_ms']:10.1f}{s['std_ms']:10.1f}{s['runs']:6d}"
        )
    for name, ratios in r["ratios_vs_kv"].items():
        print(f"  {name} / KV: " + ", ".join(f"{k[:-3]} x{v:.2f}" for k, v in ratios.items()))
    print("client stall at the switch (longest gap between two tokens)")
    for name in ("one_shot", "catch_up"):
        x = r[name]
        print(
            f"  {name:<9} mean {x['stall']['mean_ms']:7.1f} ms  max {x['stall']['max_ms']:7.1f} ms  "
            f"(normal gap {x['median_token_gap_ms']:.1f} ms; {x['tokens_handed_mean']:.0f} tokens handed, "
            f"{x['rounds_mean']:.1f} rounds, {x['peer_bytes_mean']:.0f} B relay<->main)"
        )
    print(f"  catch-up / one-shot stall: x{r['stall_catch_up_vs_one_shot']:.2f}")


def run(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.warmup < 0:
        raise SystemExit("--runs must be positive and --warmup >= 0")
    import torch

    torch.set_num_threads(args.threads)
    result = asyncio.run(_bench(args))
    if args.real_wan:
        from ..sim.emulator.params import parse_fraction, parse_rate, parse_time
        from .handoff_wan import measure

        rate, rtt, loss = args.real_wan.split(":")
        result["real_wan"] = measure(
            parse_rate(rate), parse_time(rtt) * 1e3, parse_fraction(loss), args.runs
        )
    if args.json:
        emit_json(result, indent=2)
    else:
        _print(result)
        if "real_wan" in result:
            from .handoff_wan import report

            print(report(result["real_wan"]))
    return 0
