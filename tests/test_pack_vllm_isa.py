"""vLLM's CPU backend: the layout follows the kernel set (ISA) it chose."""

from __future__ import annotations

import pytest
import torch

from kvbridge._pack.engines import vllm_cpu_isa
from kvbridge.errors import InvalidArgument, Unavailable
from kvbridge.layout import DType
from kvbridge.pack import PagedKVCache
from kvbridge.testing.engine_caches import vllm_kv_caches


def _caches(block: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return vllm_kv_caches(
        num_layers=2, num_blocks=4, num_kv_heads=2, block_size=block, head_size=64,
        dtype=dtype, layout="LBHNC",
    )  # fmt: skip


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_the_vec_kernels_layout_is_described_on_every_cpu(isa: str) -> None:
    cache = PagedKVCache.from_vllm(_caches(32), kv_split="cpu", cpu_isa=isa)
    assert cache.layout.page_tokens == 32 and cache.layout.head_dim == 64


def test_amx_tiles_are_refused_with_the_advice() -> None:
    with pytest.raises(Unavailable, match=r"AMX tiles.*not a multiple of 32"):
        PagedKVCache.from_vllm(_caches(32), kv_split="cpu", cpu_isa="amx")


def test_a_bad_isa_or_one_without_the_cpu_split_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="cpu_isa must be one of"):
        PagedKVCache.from_vllm(_caches(32), kv_split="cpu", cpu_isa="avx")
    with pytest.raises(InvalidArgument, match="kv_split='cpu'"):
        PagedKVCache.from_vllm(_caches(32), cpu_isa="vec")


def test_the_default_follows_vllms_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbridge._pack.engines as engines

    for amx in (False, True):
        monkeypatch.setattr(engines, "_has_amx_tiles", lambda amx=amx: amx)
        assert vllm_cpu_isa(DType.BF16, 32, 64) == ("amx" if amx else "vec")
        assert vllm_cpu_isa(DType.BF16, 64, 128) == ("amx" if amx else "vec")
        assert vllm_cpu_isa(DType.BF16, 16, 64) == "vec16"
        assert vllm_cpu_isa(DType.BF16, 48, 64) == "vec16"
        assert vllm_cpu_isa(DType.FP16, 32, 64) == "vec"
        assert vllm_cpu_isa(DType.FP32, 32, 64) == "vec"
        assert vllm_cpu_isa(DType.BF16, 32, 80) == "vec16"  # head size not a multiple of 32
    monkeypatch.setattr(engines, "_has_amx_tiles", lambda: True)
    with pytest.raises(Unavailable):
        PagedKVCache.from_vllm(_caches(32), kv_split="cpu")
    assert PagedKVCache.from_vllm(_caches(16), kv_split="cpu").layout.page_tokens == 16
    assert (
        PagedKVCache.from_vllm(_caches(32, torch.float16), kv_split="cpu").layout.dtype
        is DType.FP16
    )
