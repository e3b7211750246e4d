"""The demo's scenario in the simulator: its sessions, its engines' measured
step times, its emulated link, and the demo's own figures (per pipeline and
load point, means over seeds of per-seed values, as the demo reports them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..demo.config import (
    BANDWIDTH_MIN_BYTES,
    BANDWIDTH_PRIOR_SHARE,
    PREFILL_PRIOR_BASE_S,
    PREFILL_PRIOR_TOKEN_S,
    DemoConfig,
)
from ..demo.prompts import PromptBuilder
from ..demo.report import percentile
from ..reference.decoder import DecoderConfig
from .models import MeasuredTiming
from .params import Params
from .sim import FleetSpec, Outcome, SimRequest, Simulation

__all__ = ["DemoFigures", "demo_config", "demo_requests", "demo_spec", "run_demo_scenario"]


def demo_config(p: Params) -> DemoConfig:
    """The demo's configuration (its defaults: the file names the ones it uses)."""
    return DemoConfig(
        wan_rate_bps=float(p["wan.rate_bps"]),
        wan_rtt_ms=float(p["wan.rtt_ms"]),
        sessions=int(p["scenario.sessions"]),
        turns=int(p["scenario.turns"]),
    )


def _decoder(p: Params) -> DecoderConfig:
    return DecoderConfig(
        num_layers=int(p["model.layers"]),
        hidden_size=int(p["model.hidden"]),
        num_heads=int(p["model.q_heads"]),
        num_kv_heads=int(p["model.kv_heads"]),
        head_dim=int(p["model.head_dim"]),
        intermediate_size=int(p["model.intermediate"]),
        vocab_size=int(p["model.vocab"]),
    )


def demo_spec(p: Params) -> FleetSpec:
    cfg = demo_config(p)
    dec = _decoder(p)
    layout = dec.kv_layout(dtype=cfg.kv_dtype, page_tokens=cfg.p_page_tokens)
    k = float(p.get("engine.speed_ratio", 1.0))
    t = MeasuredTiming(
        p["engine.prefill_a_s"] * k,
        p["engine.prefill_b_s"] * k,
        p["engine.prefill_c_s"] * k,
        p["engine.decode_d0_s"] * k,
        p["engine.decode_d1_s"] * k,
        p["engine.decode_d2_s"] * k,
    )
    rate = cfg.wan_rate_bps / 8
    ratio = float(p["wan.wire_ratio"])
    pdd = cfg.pdd_config()
    return FleetSpec(
        prefills=1,
        relays=1,
        mains=1,
        p_timing=t,
        rld_timing=t,
        md_timing=t,
        layout=layout,
        wan_rate=rate,
        wan_rtt_s=cfg.wan_rtt_ms / 1e3,
        wan_efficiency=float(p["wan.efficiency"]),
        control_hol_bytes=float(p["wan.control_hol_bytes"]),
        handoff_hol_bytes=float(p["wan.handoff_hol_bytes"]),
        wire_ratio=ratio,
        compress_min_bytes=int(p["wan.compress_min_bytes"]),
        rdma_rate=float(p["rdma.rate_Bps"]),
        rdma_latency_s=float(p["rdma.latency_s"]),
        p_page_tokens=cfg.p_page_tokens,
        md_page_tokens=cfg.md_page_tokens,
        p_cache_pages=cfg.p_pages,
        md_pages=cfg.md_pages,
        chunk_tokens=0,
        shared_decode_cpu=True,
        router=cfg.router_config(),
        bandwidth_prior=cfg.wan_rate_bps / 8 * BANDWIDTH_PRIOR_SHARE,
        bandwidth_min_bytes=BANDWIDTH_MIN_BYTES,
        prefill_prior_token_s=PREFILL_PRIOR_TOKEN_S,
        prefill_prior_base_s=PREFILL_PRIOR_BASE_S,
        pdd=pdd,
    )


class _Builder(PromptBuilder):
    """The demo's prompt structure without its tokenizer: the trace's own
    token ids, the chat template's assistant header as ``suffix_len``
    fixed tokens (what two prompts share is exactly what the demo's share)."""

    def __init__(self, vocab: int, suffix_len: int) -> None:
        super().__init__(None, vocab)
        self.suffix = tuple(range(vocab - suffix_len, vocab))


def demo_requests(p: Params, seed: int) -> tuple[list[SimRequest], list[np.ndarray]]:
    """The seed's closed-loop sessions as the demo builds them, and the
    system prompts the caches hold at the start."""
    from ..demo.driver import build_sessions, system_prompts

    cfg = demo_config(p)
    builder = _Builder(int(p["model.vocab"]), int(p["model.prompt_suffix_tokens"]))
    sessions = build_sessions(cfg, seed, builder)
    reqs: list[SimRequest] = []
    for s in sessions:
        for t in s.turns:
            reqs.append(
                SimRequest(
                    rid=seed * 100_000 + t.index + 1,
                    session=f"{seed}/{s.index}",
                    arrival=s.start_s,
                    tokens=np.asarray(t.prompt, dtype=np.int32),
                    output_tokens=t.params.max_new_tokens,
                    think_s=t.tool_s,
                )
            )
    warm = [np.asarray(x, dtype=np.int32) for x in system_prompts(cfg, seed, builder)]
    return reqs, warm


@dataclass(frozen=True)
class DemoFigures:
    """One pipeline at one load point: means over seeds of per-seed values."""

    pipeline: str
    load: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    relay_share: float
    md_hit: float
    p_hit: float
    wan_bytes: float
    requests: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(outs: Sequence[Outcome], pipeline: str, load: float) -> DemoFigures:
    def mean(xs: list[float]) -> float:
        xs = [x for x in xs if math.isfinite(x)]
        return sum(xs) / len(xs) if xs else math.nan

    per: dict[str, list[float]] = {k: [] for k in ("p50", "p90", "p99", "rs", "md", "ph", "wb")}
    n = 0
    for o in outs:
        rs = o.requests
        n += len(rs)
        tt = [r.ttft for r in rs]
        per["p50"].append(percentile(tt, 50))
        per["p90"].append(percentile(tt, 90))
        per["p99"].append(percentile(tt, 99))
        out_tokens = sum(r.output_tokens for r in rs)
        per["rs"].append(sum(r.relay_tokens for r in rs) / max(1, out_tokens))
        n_in = max(1, sum(r.n for r in rs))
        per["md"].append(sum(r.matched for r in rs) / n_in)
        per["ph"].append(sum(r.p_hit for r in rs) / n_in)
        per["wb"].append(float(sum(r.wan_bytes for r in rs)))
    return DemoFigures(
        pipeline,
        load,
        mean(per["p50"]),
        mean(per["p90"]),
        mean(per["p99"]),
        mean(per["rs"]),
        mean(per["md"]),
        mean(per["ph"]),
        mean(per["wb"]),
        n,
    )


def run_demo_scenario(
    p: Params,
    seeds: Sequence[int] = (0, 1, 2),
    points: Sequence[tuple[str, float]] = (
        ("baseline", 1.0),
        ("same_dc", 1.0),
        ("radix", 1.0),
        ("pdd", 1.0),
        ("baseline", 1.5),
        ("pdd", 1.5),
    ),
) -> list[DemoFigures]:
    """The demo's replays in the simulator (its pipelines, seeds and loads)."""
    spec = demo_spec(p)
    reqs = {seed: demo_requests(p, seed) for seed in seeds}
    out: list[DemoFigures] = []
    for pipeline, load in points:
        outs = []
        for seed in seeds:
            rs, warm = reqs[seed]
            fresh = [r.fresh() for r in rs]
            sim = Simulation(spec, pipeline, fresh, load=load, warm=warm)
            outs.append(sim.run())
        out.append(summarize(outs, pipeline, load))
    return out
