"""pytest-benchmark microbenchmarks of pack/unpack and their baselines.

`make bench` times them; CI runs them once with --benchmark-disable, where they
still check that the timed calls produce the right bytes.  The side-by-side
ratio table is `kvbridge-bench pack`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvbridge.layout import KVLayout
from kvbridge.pack import HAS_CORE, PagedKVCache, pack, unpack
from kvbridge.testing.pack_ref import ref_pack
from kvbridge_bench.cli.pack import (
    SMOLLM2,
    Case,
    format_checksum_table,
    format_table,
    measure,
    measure_checksum,
)

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

PAGE_KIB = [2, 16, 64]


def setup_case(page_kib: int) -> dict[str, Any]:
    lay = KVLayout(
        num_layers=4, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=page_kib // 2
    )
    pages = max(1, (4 << 20) // lay.bytes_per_page)
    cache = PagedKVCache.allocate(lay, 2 * pages, backend="torch", fill="random", seed=page_kib)
    idx = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(1))[:pages]
    tokens = pages * lay.page_tokens
    return {
        "layout": lay,
        "cache": cache,
        "idx": idx,
        "bt": idx.numpy().astype(np.int32),
        "tokens": tokens,
        "wire": np.empty(lay.wire_nbytes(tokens), np.uint8),
    }


@pytest.mark.parametrize("page_kib", PAGE_KIB)
def test_bench_pack(benchmark: Any, page_kib: int) -> None:
    c = setup_case(page_kib)
    benchmark(pack, c["cache"], c["bt"], 0, c["tokens"], out=c["wire"])
    np.testing.assert_array_equal(c["wire"], ref_pack(c["cache"], c["bt"], 0, c["tokens"]).numpy())


@pytest.mark.parametrize("page_kib", PAGE_KIB)
def test_bench_unpack(benchmark: Any, page_kib: int) -> None:
    c = setup_case(page_kib)
    wire = ref_pack(c["cache"], c["bt"], 0, c["tokens"]).numpy()
    target = PagedKVCache.allocate(c["layout"], c["cache"].num_pages, backend="torch")
    benchmark(unpack, target, c["bt"], 0, c["tokens"], wire)
    np.testing.assert_array_equal(ref_pack(target, c["bt"], 0, c["tokens"]).numpy(), wire)


def test_bench_memcpy_baseline(benchmark: Any) -> None:
    src = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    benchmark(np.copyto, dst, src)
    assert np.array_equal(dst, src)


def test_bench_torch_index_select_baseline(benchmark: Any) -> None:
    c = setup_case(16)
    lay, cache, idx = c["layout"], c["cache"], c["idx"]
    per_page = lay.page_bytes_per_layer // 2 // lay.itemsize
    pool = cache.num_pages
    wire_t = torch.from_numpy(c["wire"]).view(torch.float16).view(lay.num_layers, 2, -1, per_page)
    views = [v.view(2, pool, per_page) for v in cache.layer_views()]

    def torch_pack() -> None:
        for layer, v in enumerate(views):
            for comp in range(2):
                torch.index_select(v[comp], 0, idx, out=wire_t[layer, comp])

    benchmark(torch_pack)
    np.testing.assert_array_equal(c["wire"], ref_pack(cache, c["bt"], 0, c["tokens"]).numpy())


def test_ratio_table_row() -> None:
    """The CLI's measurement on tiny cases: one timed run of each variant, the
    torch code checked against kvbridge first."""
    tiny = [
        Case("tiny", KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16)),
        Case("tiny vLLM", vllm={**SMOLLM2, "num_layers": 2, "block_size": 16, "layout": "LBHNC"}),
        Case("tiny vLLM-CPU", vllm={**SMOLLM2, "num_layers": 2, "block_size": 32,
                                    "layout": "LBHNC", "kv_split": "cpu"}),
    ]  # fmt: skip
    rows = []
    for case in tiny:
        ticks = [0]

        def tick(ticks: list[int] = ticks) -> None:
            ticks[0] += 1

        row = measure(case, 0.25, reps=1, warmup=0, num_threads=2, tick=tick)
        assert ticks == [1]
        assert set(row["seconds"]) == {
            "memcpy_1", "memcpy_n", "pack", "torch_pack", "unpack", "torch_unpack",
        }  # fmt: skip
        assert row["threads"] == 2 and all(v > 0 for v in row["seconds"].values())
        share = row["huge_pages"]
        assert set(share) == {"cache", "memcpy_src", "wire", "unpack_src"}
        assert all(0.0 <= v <= 1.0 for v in share.values())
        rows.append(row)
    assert "tiny vLLM" in format_table(rows)
    check = measure_checksum(tiny[1], 0.25, reps=1, warmup=0, tick=lambda: None)
    assert check["fused_vs_pack_then_core_xxh3"] > 0
    assert "tiny vLLM" in format_checksum_table([check])


def test_cli_json(capfd: pytest.CaptureFixture[str]) -> None:
    """stdout: the JSON alone (the file descriptor, so capfd)."""
    import json

    from kvbridge_bench.cli.main import main

    argv = ["pack", "--quick", "--json", "--mib", "0.25", "--reps", "1", "--warmup", "0"]
    assert main(argv) == 0
    out = json.loads(capfd.readouterr().out)
    rows = out["rows"]
    assert [r["case"] for r in rows][:3] == [
        "Llama-3-8B fp16",
        "Llama-3-8B bf16",
        "DeepSeek-V3 MLA bf16",
    ]
    assert any(r["case"].startswith("vLLM LBHNC 16") for r in rows)
    assert {r["page_bytes"] for r in rows} >= {2048, 16384, 262144, 32768}
    assert {c["case"] for c in out["checksum"]} >= {"Llama-3-8B bf16", "vLLM LBHNC 16 SmolLM2"}


@pytest.mark.parametrize("how", ["read", "zero-fill+read_into"])
def test_bench_sender_chunk_prepare(benchmark: Any, how: str) -> None:
    """What the TCP sender does per 4 MiB chunk of KV pages: pack and checksum.
    ``read`` hands over a buffer the pack core filled; the other way zero-fills
    a new buffer first (one more memory pass)."""
    from kvbridge.transport.tcp.kvio import KVSource
    from kvbridge.wire.chunk import checksum

    c = setup_case(64)
    source = KVSource(c["cache"], c["bt"], 0, c["tokens"], None)
    n = min(4 << 20, source.nbytes)

    def prepare() -> int:
        if how == "read":
            buf: Any = source.read(0, n)
        else:
            buf = bytearray(n)
            source.read_into(0, memoryview(buf))
        return checksum(buf)

    got = benchmark(prepare)
    assert got == checksum(ref_pack(c["cache"], c["bt"], 0, c["tokens"]).numpy()[:n])
