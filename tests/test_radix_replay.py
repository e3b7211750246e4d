"""The trace replay through negotiation, radix cache and router (sans-IO)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge.layout import KVLayout
from kvbridge.router import RouterConfig
from kvbridge_bench.cli import radix as radix_cli
from kvbridge_bench.sim.prefix_bench import run_prefix_bench
from kvbridge_bench.sim.trace import AgentTraceConfig, Trace, generate_agent_trace
from kvbridge_bench.sim.trace_format import write_jsonl

LAYOUT = KVLayout.for_model("llama-3-8b")


@pytest.fixture(scope="module")
def demo_trace() -> Trace:
    return generate_agent_trace(AgentTraceConfig.demo(seed=0, num_sessions=10))


def test_radix_cuts_wan_bytes_and_tracks_the_prefill_side(demo_trace: Trace) -> None:
    rep = run_prefix_bench(demo_trace, LAYOUT, md_pages=None)
    assert rep.bytes_without_radix == LAYOUT.bytes_per_token * demo_trace.total_tokens
    assert rep.wan_reduction >= 8.0
    assert rep.md_mean_hit <= rep.p_mean_hit  # page granularity can only lose
    assert rep.mean_abs_hit_gap < 0.02
    assert set(rep.pipelines) <= {"P-MD", "P-RLD-MD"}
    assert sum(rep.pipelines.values()) == rep.requests == len(demo_trace)
    # per-request bytes agree with the negotiated match
    for rec in rep.records:
        assert rec.wan_bytes == (rec.num_tokens - rec.md_hit_tokens) * LAYOUT.bytes_per_token
        assert rec.md_hit_tokens % 16 == 0 and rec.md_hit_tokens <= rec.p_hit_tokens


def test_a_tight_page_budget_shows_as_misalignment(demo_trace: Trace) -> None:
    roomy = run_prefix_bench(demo_trace, LAYOUT, md_pages=None)
    tight = run_prefix_bench(demo_trace, LAYOUT, md_pages=160)
    assert tight.evicted_pages > 0
    assert tight.md_token_hit < roomy.md_token_hit - 0.05
    assert tight.mean_abs_hit_gap > roomy.mean_abs_hit_gap
    assert tight.bytes_with_radix > roomy.bytes_with_radix
    with pytest.raises(InvalidArgument):
        run_prefix_bench(demo_trace, LAYOUT, md_pages=10)


def test_slow_wan_shifts_requests_to_the_relay(demo_trace: Trace) -> None:
    cfg = RouterConfig(ttft_target_s=1.0)
    fast = run_prefix_bench(
        demo_trace,
        LAYOUT,
        md_pages=None,
        wan_bps=1.25e10,
        router_config=cfg,
        bandwidth_prior_bps=1.25e10,
    )
    slow = run_prefix_bench(
        demo_trace,
        LAYOUT,
        md_pages=None,
        wan_bps=1.25e8,
        router_config=cfg,
        bandwidth_prior_bps=1.25e8,
    )
    assert slow.pipelines.get("P-RLD-MD", 0) > fast.pipelines.get("P-RLD-MD", 0)


def test_cli_on_a_user_trace(
    tmp_path: Path, demo_trace: Trace, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl(demo_trace, path)
    parser = argparse.ArgumentParser()
    radix_cli.add_arguments(parser)
    out = tmp_path / "r.json"
    args = parser.parse_args(
        ["--trace", str(path), "--md-pages", "none,400", "--json", str(out), "--skip-lookup-bench"]
    )
    assert radix_cli.run(args) == 0
    figures = json.loads(out.read_text())
    assert len(figures["runs"]) == 2 and figures["runs"][0]["wan_reduction"] >= 8
    assert "reduction" in capsys.readouterr().out


def test_filtered_requests_send_nothing_and_are_not_cached(demo_trace: Trace) -> None:
    cfg = RouterConfig(
        ttft_target_s=0.05,
        anomalous_filter=True,
        anomalous_min_input_tokens=1024,
        anomalous_max_output_tokens=500,
        anomalous_max_share=0.3,
    )
    rep = run_prefix_bench(demo_trace, LAYOUT, md_pages=None, router_config=cfg)
    filtered = [r for r in rep.records if r.decision.pipeline.value == "P-RLD"]
    assert filtered and len(filtered) <= 0.3 * rep.requests
    assert all(r.wan_bytes == 0 for r in filtered)
    assert rep.bytes_with_radix == sum(r.wan_bytes for r in rep.records)
    # what the relay finished is missing on the main decode: its hit rate slips
    plain = run_prefix_bench(demo_trace, LAYOUT, md_pages=None)
    assert rep.md_token_hit < plain.md_token_hit
