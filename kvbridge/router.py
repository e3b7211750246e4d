"""The pipeline router: P-MD or P-RLD-MD for each request (sans-IO).

A request goes straight to the main decode (P-MD) when the KV it lacks
there can cross the WAN within the first-token target; otherwise the relay
decode masks the transfer (P-RLD-MD).  Both end at the main decode.  P-RLD
(finishing on the relay) is excluded, except through the opt-in
anomalous-traffic filter: ultra-long input, ultra-short output, the WAN too
slow for the target, and a bounded share of recent requests.

The estimate of P-MD's first token is ``prefill_s + wan_s``:
``wan_s = base_latency + (queued_bytes + missing_bytes) / bandwidth`` with
``missing_bytes = (input_tokens - matched_tokens) * bytes_per_token`` and
``bandwidth`` a conservative live estimate (:class:`BandwidthEstimator`)
fed by transfer completions; ``prefill_s`` is the prefill's time to its
first token, work queued ahead included (:class:`PrefillEstimator`, fed by
the prefill's own measurements).  Every decision is logged on the
``kvbridge.router`` logger and returned as a :class:`Decision`.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import InvalidArgument
from .layout import KVLayout

__all__ = [
    "BandwidthEstimator",
    "Decision",
    "Pipeline",
    "PrefillEstimator",
    "Reason",
    "Router",
    "RouterConfig",
]

log = logging.getLogger("kvbridge.router")


class Pipeline(str, enum.Enum):
    P_MD = "P-MD"
    P_RLD_MD = "P-RLD-MD"
    P_RLD = "P-RLD"  # only through the anomalous-traffic filter


class Reason(str, enum.Enum):
    FITS_TARGET = "wan-fits-target"  # P-MD: the missing KV arrives in time
    EXCEEDS_TARGET = "wan-exceeds-target"  # P-RLD-MD: the relay masks the transfer
    ANOMALOUS = "anomalous-filter"  # P-RLD: long input, short output, share left
    FILTER_SHARE_SPENT = "filter-share-spent"  # would be filtered, but the share is used up
    SMALL_GAIN = "relay-gain-too-small"  # P-MD: the WAN part is below min_relay_gain_s
    NO_RELAY = "no-relay"  # P-MD: P-RLD-MD would be chosen, but the fleet has no relay


class BandwidthEstimator:
    """Conservative EWMA of WAN goodput from transfer completions.

    ``estimate = max(floor, mean - k_sigma * std)`` over an exponentially
    weighted mean and variance of per-transfer throughput (bytes / seconds),
    starting from ``prior_bps`` with a prior spread of ``prior_cv * prior``.
    Transfers under ``min_bytes`` are ignored: latency dominates them.
    """

    def __init__(
        self,
        prior_bps: float = 1.25e8,  # 1 Gbit/s: a low guess for a leased line
        *,
        alpha: float = 0.2,
        k_sigma: float = 1.0,
        prior_cv: float = 0.25,
        min_bytes: int = 1 << 18,
        floor_bps: float = 1e6,
    ) -> None:
        if not (prior_bps > 0 and 0 < alpha <= 1 and k_sigma >= 0 and floor_bps > 0):
            raise InvalidArgument("bandwidth estimator parameters out of range")
        self.alpha = alpha
        self.k_sigma = k_sigma
        self.min_bytes = min_bytes
        self.floor_bps = floor_bps
        self.mean = float(prior_bps)
        self.var = (prior_cv * prior_bps) ** 2
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """One completed transfer: ``nbytes`` landed in ``seconds``."""
        if nbytes < 0 or not seconds > 0 or not math.isfinite(seconds):
            raise InvalidArgument(f"bad transfer sample ({nbytes} B in {seconds} s)")
        if nbytes < self.min_bytes:
            return
        x = nbytes / seconds
        d = x - self.mean
        self.mean += self.alpha * d
        self.var = (1 - self.alpha) * (self.var + self.alpha * d * d)
        self.samples += 1

    @property
    def estimate_bps(self) -> float:
        return max(self.floor_bps, self.mean - self.k_sigma * math.sqrt(self.var))


class PrefillEstimator:
    """The prefill's time to first token for a request that computes
    ``tokens`` tokens (its prompt less its prefill-side prefix-cache hit)
    behind ``queued_tokens`` tokens of other requests' prefill:
    ``(queued_requests + 1) * base_s + (queued_tokens + tokens) * token_s``.
    ``token_s`` and ``base_s`` are exponentially weighted from observed
    prefills (``observe``): ``token_s`` from passes of at least
    ``min_tokens`` tokens, ``base_s`` from shorter ones."""

    def __init__(
        self,
        prior_token_s: float = 0.002,
        prior_base_s: float = 0.01,
        *,
        alpha: float = 0.3,
        min_tokens: int = 32,
    ) -> None:
        if not (prior_token_s > 0 and prior_base_s >= 0 and 0 < alpha <= 1 and min_tokens >= 1):
            raise InvalidArgument("prefill estimator parameters out of range")
        self.token_s = float(prior_token_s)
        self.base_s = float(prior_base_s)
        self.alpha = alpha
        self.min_tokens = min_tokens
        self.samples = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One prefill pass: ``tokens`` tokens computed in ``seconds``."""
        if tokens < 0 or not seconds >= 0 or not math.isfinite(seconds):
            raise InvalidArgument(f"bad prefill sample ({tokens} tokens in {seconds} s)")
        a = self.alpha
        if tokens >= self.min_tokens:
            per = max(seconds - self.base_s, 0.0) / tokens
            self.token_s += a * (per - self.token_s)
        else:
            self.base_s += a * (max(seconds - tokens * self.token_s, 0.0) - self.base_s)
        self.samples += 1

    def estimate(self, tokens: int, queued_tokens: int = 0, queued_requests: int = 0) -> float:
        if tokens < 0 or queued_tokens < 0 or queued_requests < 0:
            raise InvalidArgument("token and request counts must be >= 0")
        return (queued_requests + 1) * self.base_s + (queued_tokens + tokens) * self.token_s


@dataclass(frozen=True)
class RouterConfig:
    ttft_target_s: float = 2.0
    base_latency_s: float = 0.05  # WAN round trip + handshake, added to every estimate
    # P-MD whatever the target when the WAN part is this short: the relay would
    # hide too little to be worth a handoff (0: the target alone decides)
    min_relay_gain_s: float = 0.0
    anomalous_filter: bool = False
    anomalous_min_input_tokens: int = 32768
    anomalous_max_output_tokens: int = 500  # expected output strictly below this
    anomalous_max_share: float = 0.04
    share_window: int = 1000

    def __post_init__(self) -> None:
        if not self.ttft_target_s > 0 or self.base_latency_s < 0 or self.min_relay_gain_s < 0:
            raise InvalidArgument(
                "ttft_target_s must be > 0, base_latency_s and min_relay_gain_s >= 0"
            )
        if not 0 <= self.anomalous_max_share <= 1 or self.share_window < 1:
            raise InvalidArgument("anomalous_max_share in [0, 1] and share_window >= 1")


@dataclass(frozen=True)
class Decision:
    request_id: str
    pipeline: Pipeline
    reason: Reason
    input_tokens: int
    matched_tokens: int
    missing_tokens: int
    missing_bytes: int
    queued_bytes: int
    bandwidth_bps: float
    queue_s: float
    wan_s: float  # base latency + queue + missing bytes
    prefill_s: float
    ttft_target_s: float

    @property
    def est_ttft_s(self) -> float:
        return self.prefill_s + self.wan_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pipeline"] = self.pipeline.value
        d["reason"] = self.reason.value
        return d


_DECISION_FIELDS = tuple(f.name for f in fields(Decision))


def _decision(*values: Any) -> Decision:
    """``Decision(*values)`` without the frozen dataclass's one
    ``object.__setattr__`` call per field (a fleet router makes one per
    request): the same fields, equal to the constructor's."""
    d = object.__new__(Decision)
    d.__dict__.update(zip(_DECISION_FIELDS, values, strict=True))
    return d


class Router:
    """Chooses a pipeline per request; see the module docstring."""

    def __init__(
        self,
        layout: KVLayout,
        config: RouterConfig | None = None,
        bandwidth: BandwidthEstimator | None = None,
        prefill: PrefillEstimator | None = None,
    ) -> None:
        self.layout = layout
        self.config = config or RouterConfig()
        self.bandwidth = bandwidth or BandwidthEstimator()
        self.prefill = prefill or PrefillEstimator()
        self.counts: Counter[Pipeline] = Counter()
        self._recent: deque[bool] = deque(maxlen=self.config.share_window)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """Feed a completed WAN transfer into the bandwidth estimate."""
        self.bandwidth.observe(nbytes, seconds)

    def decide(
        self,
        request_id: str,
        input_tokens: int,
        matched_tokens: int,
        expected_output_tokens: int,
        *,
        queued_bytes: int = 0,
        prefill_s: float | None = None,
        compute_tokens: int | None = None,
        queued_tokens: int = 0,
        queued_requests: int = 0,
    ) -> Decision:
        """Route one request.  ``matched_tokens``: what the main decode holds
        (the PREFIX_REPLY); ``queued_bytes``: bytes ahead of it on the WAN
        link; ``prefill_s``: the prefill's own time to first token, or else
        estimated by :attr:`prefill` for ``compute_tokens`` tokens to compute
        behind ``queued_tokens`` / ``queued_requests`` (0 when neither is given)."""
        if not 0 <= matched_tokens <= input_tokens:
            raise InvalidArgument(f"need 0 <= matched ({matched_tokens}) <= input ({input_tokens})")
        if prefill_s is None:
            prefill_s = (
                0.0
                if compute_tokens is None
                else self.prefill.estimate(compute_tokens, queued_tokens, queued_requests)
            )
        if expected_output_tokens < 0 or queued_bytes < 0 or prefill_s < 0:
            raise InvalidArgument("expected output, queued bytes and prefill time must be >= 0")
        cfg = self.config
        missing = input_tokens - matched_tokens
        nbytes = missing * self.layout.bytes_per_token
        bw = self.bandwidth.estimate_bps
        queue_s = queued_bytes / bw
        wan_s = cfg.base_latency_s + queue_s + nbytes / bw
        if prefill_s + wan_s <= cfg.ttft_target_s:
            pipeline, reason = Pipeline.P_MD, Reason.FITS_TARGET
        elif wan_s < cfg.min_relay_gain_s:
            pipeline, reason = Pipeline.P_MD, Reason.SMALL_GAIN
        elif (
            cfg.anomalous_filter
            and input_tokens >= cfg.anomalous_min_input_tokens
            and expected_output_tokens < cfg.anomalous_max_output_tokens
        ):
            filtered = sum(self._recent) + 1
            if filtered <= cfg.anomalous_max_share * (len(self._recent) + 1):
                pipeline, reason = Pipeline.P_RLD, Reason.ANOMALOUS
            else:
                pipeline, reason = Pipeline.P_RLD_MD, Reason.FILTER_SHARE_SPENT
        else:
            pipeline, reason = Pipeline.P_RLD_MD, Reason.EXCEEDS_TARGET
        self._recent.append(pipeline is Pipeline.P_RLD)
        self.counts[pipeline] += 1
        d = _decision(
            request_id, pipeline, reason, input_tokens, matched_tokens, missing, nbytes,
            queued_bytes, bw, queue_s, wan_s, prefill_s, cfg.ttft_target_s,
        )  # fmt: skip
        if log.isEnabledFor(logging.INFO):
            log.info(
                "request %s -> %s (%s): %d of %d tokens missing = %d B; est. WAN %.3f s "
                "(queue %.3f s) + prefill %.3f s vs target %.3f s at %.1f MB/s",
                request_id,
                pipeline.value,
                reason.value,
                missing,
                input_tokens,
                nbytes,
                wan_s,
                queue_s,
                prefill_s,
                cfg.ttft_target_s,
                bw / 1e6,
            )
        return d
