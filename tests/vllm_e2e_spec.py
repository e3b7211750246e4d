"""The cluster that tests/test_vllm_e2e.py starts, shared with the plain
suite's check that docs/vllm.md shows its exact commands."""

from __future__ import annotations

from pathlib import Path

from kvbridge_bench.cli.vllm_cluster import ClusterSpec

# float32: vLLM's CPU kernels round differently for a one-token decode step and
# a multi-token prefill; in bf16 that flips near-ties between equal
# computations (docs/vllm.md, "Exactness"), in float32 it does not on the test prompts
DTYPE = "float32"
MD_BLOCK, P_BLOCK = 64, 32


def e2e_spec(model_dir: str, workdir: Path) -> ClusterSpec:
    return ClusterSpec(
        model_dir=model_dir,
        workdir=workdir,
        p_block=P_BLOCK,
        md_block=MD_BLOCK,
        rld_block=P_BLOCK,
        dtype=DTYPE,
        num_blocks=256,
        wan_rate_bps=2e8,
        wan_rtt_ms=40,
        md_policy="recompute",
        rld_policy="fail",
        recv_timeout_s=15.0,
        proxy_args=["--relay-token-budget", "16", "--pipeline", "p-md", "--await-tickets-s", "10"],
    )
