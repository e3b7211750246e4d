"""Router decisions on crafted cases, and the bandwidth estimator."""

from __future__ import annotations

import logging

import pytest

from kvbridge.errors import InvalidArgument
from kvbridge.layout import KVLayout
from kvbridge.router import BandwidthEstimator, Pipeline, Reason, Router, RouterConfig

LAYOUT = KVLayout.for_model("llama-3-8b")  # 131072 B per token
BPT = LAYOUT.bytes_per_token
GBIT = 1.25e8  # bytes/s


def fixed_bw(bps: float) -> BandwidthEstimator:
    return BandwidthEstimator(bps, k_sigma=0.0)


def router(**cfg: object) -> Router:
    return Router(LAYOUT, RouterConfig(**cfg), fixed_bw(10 * GBIT))  # type: ignore[arg-type]


def test_high_hit_goes_straight_to_main_decode() -> None:
    r = router(ttft_target_s=2.0, base_latency_s=0.05)
    d = r.decide("a", input_tokens=64_000, matched_tokens=62_000, expected_output_tokens=1000)
    # 2000 tokens * 128 KiB = 262 MB at 1.25 GB/s = 0.21 s
    assert d.pipeline is Pipeline.P_MD and d.reason is Reason.FITS_TARGET
    assert d.missing_bytes == 2000 * BPT
    assert d.wan_s == pytest.approx(0.05 + 2000 * BPT / (10 * GBIT))


def test_low_hit_goes_through_the_relay() -> None:
    r = router(ttft_target_s=2.0)
    d = r.decide("b", input_tokens=64_000, matched_tokens=6_400, expected_output_tokens=1000)
    assert d.pipeline is Pipeline.P_RLD_MD and d.reason is Reason.EXCEEDS_TARGET
    assert d.wan_s > 2.0


def test_queue_ahead_tips_the_balance() -> None:
    r = router(ttft_target_s=1.0, base_latency_s=0.0)
    small = dict(input_tokens=10_000, matched_tokens=5_000, expected_output_tokens=100)
    assert r.decide("c", **small).pipeline is Pipeline.P_MD  # 0.52 s
    d = r.decide("d", **small, queued_bytes=int(0.6 * 10 * GBIT))
    assert d.pipeline is Pipeline.P_RLD_MD and d.queue_s == pytest.approx(0.6)


def test_prefill_time_counts_against_the_target() -> None:
    r = router(ttft_target_s=1.0, base_latency_s=0.0)
    args = dict(input_tokens=10_000, matched_tokens=5_000, expected_output_tokens=100)
    assert r.decide("e", **args, prefill_s=0.4).pipeline is Pipeline.P_MD
    assert r.decide("f", **args, prefill_s=0.5).pipeline is Pipeline.P_RLD_MD


def test_full_hit_and_empty_prompt() -> None:
    r = router()
    d = r.decide("g", input_tokens=1000, matched_tokens=1000, expected_output_tokens=10)
    assert d.missing_bytes == 0 and d.pipeline is Pipeline.P_MD
    assert r.decide("h", 0, 0, 0).pipeline is Pipeline.P_MD


def test_never_finishes_on_the_relay_without_the_filter() -> None:
    r = router(ttft_target_s=0.1)
    for i in range(200):
        d = r.decide(str(i), input_tokens=100_000, matched_tokens=0, expected_output_tokens=10)
        assert d.pipeline is Pipeline.P_RLD_MD
    assert r.counts[Pipeline.P_RLD] == 0


def test_anomalous_filter_is_bounded_and_selective() -> None:
    r = router(ttft_target_s=1.0, anomalous_filter=True, anomalous_max_share=0.04)
    normal = dict(input_tokens=20_000, matched_tokens=0, expected_output_tokens=800)
    anomalous = dict(input_tokens=60_000, matched_tokens=0, expected_output_tokens=200)
    first = r.decide("x0", **anomalous)
    assert first.pipeline is Pipeline.P_RLD_MD and first.reason is Reason.FILTER_SHARE_SPENT
    got = []
    for i in range(1000):
        d = r.decide(str(i), **(anomalous if i % 10 == 0 else normal))
        got.append(d.pipeline)
        if d.pipeline is Pipeline.P_RLD:
            assert d.reason is Reason.ANOMALOUS and d.input_tokens == 60_000
    share = got.count(Pipeline.P_RLD) / len(got)
    assert 0.03 <= share <= 0.04
    # a long input whose output is not short is never filtered
    for i in range(100):
        d = r.decide(f"y{i}", input_tokens=60_000, matched_tokens=0, expected_output_tokens=500)
        assert d.pipeline is Pipeline.P_RLD_MD
    # nor one that fits the target anyway (keeps the main decode's cache aligned)
    d = r.decide("z", input_tokens=60_000, matched_tokens=59_990, expected_output_tokens=10)
    assert d.pipeline is Pipeline.P_MD


def test_bandwidth_estimator_is_conservative_and_learns() -> None:
    est = BandwidthEstimator(prior_bps=GBIT, k_sigma=1.0, prior_cv=0.25)
    assert est.estimate_bps == pytest.approx(0.75 * GBIT)
    est.observe(1000, 1.0)  # too small: ignored
    assert est.samples == 0
    for _ in range(40):
        est.observe(int(5 * GBIT), 1.0)  # steady 5 Gbit/s
    assert 0.95 * 5 * GBIT <= est.estimate_bps <= 5 * GBIT
    for i in range(40):  # jittery link: the estimate drops below the mean
        est.observe(int((2 + 6 * (i % 2)) * GBIT), 1.0)
    assert est.estimate_bps < 4 * GBIT < est.mean
    with pytest.raises(InvalidArgument):
        est.observe(10, 0.0)


def test_router_uses_live_bandwidth() -> None:
    r = Router(
        LAYOUT,
        RouterConfig(ttft_target_s=1.0, base_latency_s=0.0),
        BandwidthEstimator(GBIT, k_sigma=0.0),
    )
    args = dict(input_tokens=5_000, matched_tokens=0, expected_output_tokens=100)
    assert r.decide("1", **args).pipeline is Pipeline.P_RLD_MD  # 655 MB at 125 MB/s
    for _ in range(30):
        r.observe_transfer(int(1e9), 1.0)
    assert r.decide("2", **args).pipeline is Pipeline.P_MD


def test_decisions_are_logged_with_reason(caplog: pytest.LogCaptureFixture) -> None:
    r = router()
    with caplog.at_level(logging.INFO, logger="kvbridge.router"):
        d = r.decide("req-7", 1000, 0, 10)
    assert "req-7 -> P-MD (wan-fits-target)" in caplog.text
    assert d.as_dict()["pipeline"] == "P-MD"


@pytest.mark.parametrize("args", [(10, 11, 0), (10, -1, 0), (-1, 0, 0), (10, 0, -1)])
def test_bad_arguments_rejected(args: tuple[int, int, int]) -> None:
    with pytest.raises(InvalidArgument):
        router().decide("bad", *args)
    with pytest.raises(InvalidArgument):
        RouterConfig(ttft_target_s=0)


def test_prefill_time_counts_in_the_decision() -> None:
    from kvbridge.router import PrefillEstimator

    est = PrefillEstimator(prior_token_s=0.001, prior_base_s=0.01, alpha=1.0)
    est.observe(1000, 2.01)  # 2 ms per token measured
    assert abs(est.token_s - 0.002) < 1e-9
    est.observe(4, 0.05)  # a short pass: its fixed cost
    assert abs(est.base_s - (0.05 - 4 * 0.002)) < 1e-9
    want = 2 * est.base_s + 500 * est.token_s
    assert abs(est.estimate(100, queued_tokens=400, queued_requests=1) - want) < 1e-9
    r = Router(LAYOUT, RouterConfig(ttft_target_s=0.5), fixed_bw(100 * GBIT), est)
    # the WAN alone fits the target; with the prefill queue ahead it does not
    fast = r.decide("a", 1000, 900, 50, compute_tokens=10)
    assert fast.pipeline is Pipeline.P_MD and fast.prefill_s == est.estimate(10)
    slow = r.decide("b", 1000, 900, 50, compute_tokens=10, queued_tokens=400, queued_requests=2)
    assert slow.pipeline is Pipeline.P_RLD_MD and slow.prefill_s > 0.5
    assert r.decide("c", 1000, 900, 50, prefill_s=0.0).prefill_s == 0.0
    with pytest.raises(InvalidArgument):
        est.observe(-1, 1.0)
