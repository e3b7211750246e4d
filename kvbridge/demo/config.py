"""The demo's configuration: one JSON-serialisable dataclass shared by the
driver and the role processes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..layout import KVLayout
from ..reference.decoder import DecoderConfig

__all__ = ["DemoConfig"]


@dataclass
class DemoConfig:
    # the model (the reference decoder; same seeded weights on every role)
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 2048
    model_seed: int = 0
    kv_dtype: str = "fp32"
    # heterogeneous caches: prefill and relay (same datacenter, same chips)
    # share one layout; the main decode has another page size and order
    p_page_tokens: int = 16
    p_order: str = "kv_first"
    p_head_order: str = "NHD"
    md_page_tokens: int = 32
    md_order: str = "page_first"
    md_head_order: str = "HND"
    p_pages: int = 3072
    rld_pages: int = 3072
    md_pages: int = 2048
    # the WAN between datacenters
    wan_mode: str = "auto"  # "netns" (packet-level), "proxy", or "auto"
    wan_rate_bps: float = 40e6
    wan_rtt_ms: float = 40.0
    wan_loss: float = 0.0
    wan_streams: int = 4
    wan_chunk: int = 256 << 10
    wan_secret: str = "kvbridge-demo"  # per-peer PSKs are derived from it
    # prefill -> relay inside datacenter A
    rld_transport: str = "ucx"  # "ucx" or "tcp"
    # decode speed (emulated compute per step, added to the real one)
    decode_s: float = 0.02
    extend_base_s: float = 0.02
    extend_token_s: float = 0.0005
    # handoff
    handoff_threshold: int = 16
    relay_token_budget: int = 24  # capped below each request's output length
    relay_capped_wait_s: float = 5.0
    # router
    ttft_target_s: float = 0.5
    # sampling
    temperature: float = 0.8
    top_k: int = 50
    max_new_tokens: int = 48
    min_new_tokens: int = 24
    # trace
    trace_seed: int = 0
    trace_sessions: int = 4
    max_requests: int = 40
    arrival_scale: float = 1.0  # multiply the trace's arrival times
    request_timeout_s: float = 60.0
    pipelines: list[str] = field(default_factory=lambda: ["baseline", "radix", "pdd"])

    # ---- derived ------------------------------------------------------------
    def decoder_config(self) -> DecoderConfig:
        return DecoderConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            seed=self.model_seed,
        )

    def p_layout(self) -> KVLayout:
        return self.decoder_config().kv_layout(
            dtype=self.kv_dtype,
            page_tokens=self.p_page_tokens,
            order=self.p_order,
            head_order=self.p_head_order,
        )

    def md_layout(self) -> KVLayout:
        return self.decoder_config().kv_layout(
            dtype=self.kv_dtype,
            page_tokens=self.md_page_tokens,
            order=self.md_order,
            head_order=self.md_head_order,
        )

    def psk(self, identity: str) -> bytes:
        """The pre-shared key of one WAN peer (derived; a real deployment
        provisions its own keys)."""
        import hashlib

        return hashlib.blake2b(identity.encode(), key=self.wan_secret.encode()).digest()[:32]

    # ---- presets and (de)serialisation ------------------------------------------
    @classmethod
    def smoke(cls) -> DemoConfig:
        """A reduced run for CI: few short requests, same code paths."""
        return cls(
            trace_sessions=2,
            max_requests=8,
            max_new_tokens=20,
            min_new_tokens=12,
            arrival_scale=0.5,
            p_pages=1024,
            rld_pages=1024,
            md_pages=1024,
        )

    def replace(self, **changes: Any) -> DemoConfig:
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoConfig:
        return cls(**json.loads(text))
