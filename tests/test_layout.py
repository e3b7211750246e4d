"""KVLayout: sizes from real model configs, byte strides that agree with the
tensor shapes, stable compatibility hashes, and typed errors for bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvbridge.errors import LayoutError
from kvbridge.layout import DType, HeadOrder, KVLayout, MemoryOrder, WireRange
from kvbridge.models import MODEL_CONFIGS


@pytest.mark.parametrize(
    "model, per_token",
    [
        ("llama-3-8b", 131072),
        ("llama-3-70b", 327680),
        ("qwen2.5-7b", 57344),
        ("deepseek-v3", 70272),
    ],
)
def test_bytes_per_token_of_real_models(model: str, per_token: int) -> None:
    lay = KVLayout.for_model(model)
    assert lay.bytes_per_token == per_token
    assert lay.bytes_per_page == 16 * per_token
    assert lay.wire_nbytes(100) == 100 * per_token
    assert lay.wire_nbytes(100, (1, 3)) == 100 * per_token * 2 // lay.num_layers


def test_mla_layout() -> None:
    lay = KVLayout.for_model("deepseek-v3", page_tokens=64)
    assert lay.mla and lay.num_components == 1 and lay.head_dim == 576
    assert lay.layer_shape(10) == (10, 64, 576)
    with pytest.raises(LayoutError):
        lay.replace(head_order="HND")
    with pytest.raises(LayoutError):
        lay.replace(num_kv_heads=2)


ORDERS = list(itertools.product(["kv_first", "page_first"], ["NHD", "HND"], [False, True]))


@pytest.mark.parametrize("order, heads, mla", ORDERS)
def test_byte_strides_agree_with_the_tensor_shape(order: str, heads: str, mla: bool) -> None:
    lay = KVLayout(
        num_layers=2,
        num_kv_heads=1 if mla else 3,
        head_dim=8,
        dtype="fp16",
        page_tokens=4,
        order=order,
        head_order="NHD" if mla else heads,
        mla=mla,
    )
    pages = 5
    shape = lay.layer_shape(pages)
    sc, sp, st, sh = lay.byte_strides(pages)
    rng = np.random.default_rng(0)
    for _ in range(50):
        c = 0 if mla else int(rng.integers(2))
        p, t, h = (
            int(rng.integers(pages)),
            int(rng.integers(4)),
            int(rng.integers(lay.num_kv_heads)),
        )
        if mla:
            idx = (p, t, 0)
        elif order == "kv_first":
            idx = (c, p, t, h, 0) if heads == "NHD" else (c, p, h, t, 0)
        else:
            idx = (p, c, t, h, 0) if heads == "NHD" else (p, c, h, t, 0)
        want = int(np.ravel_multi_index(idx, shape)) * lay.itemsize
        assert c * sc + p * sp + t * st + h * sh == want


def test_compat_hash_ignores_page_size_and_order_but_not_the_model() -> None:
    a = KVLayout.for_model("llama-3-8b")
    b = KVLayout.for_model("llama-3-8b", page_tokens=64, order="flashinfer", head_order="HND")
    assert a.compat_hash == b.compat_hash and a.exact_hash != b.exact_hash
    assert a.compat_hash != KVLayout.for_model("llama-3-8b", dtype="fp16").compat_hash
    assert a.compat_hash != KVLayout.for_model("llama-3-70b").compat_hash
    a.check_wire_compatible(b)
    with pytest.raises(LayoutError):
        a.check_wire_compatible(KVLayout.for_model("qwen2.5-7b"))
    # stable across processes and versions: peers compare it on the wire
    assert a.compat_hash == 0x7B8312D478B1A69F


def test_parsing_and_bad_input() -> None:
    assert (
        DType.parse("torch.bfloat16") is DType.BF16 and DType.parse("float8_e4m3fn").itemsize == 1
    )
    with pytest.raises(LayoutError, match="from_vllm"):  # vLLM 0.26+ is not kv_first
        MemoryOrder.parse("vllm")
    assert HeadOrder.parse("hnd") is HeadOrder.HND
    for bad in ("int4", "complex64"):
        with pytest.raises(LayoutError):
            DType.parse(bad)
    with pytest.raises(LayoutError):
        MemoryOrder.parse("sideways")
    with pytest.raises(LayoutError):
        KVLayout(num_layers=0, num_kv_heads=1, head_dim=8)
    with pytest.raises(LayoutError):
        KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, page_tokens=True)  # type: ignore[arg-type]
    with pytest.raises(LayoutError):
        KVLayout.from_hf_config({"hidden_size": 64})
    with pytest.raises(LayoutError):
        KVLayout.for_model("gpt-9")
    lay = KVLayout.for_model("qwen2.5-7b")
    with pytest.raises(LayoutError):
        lay.layer_range((3, 40))
    with pytest.raises(LayoutError):
        lay.wire_nbytes(-1)
    with pytest.raises(LayoutError):
        WireRange(5, 3).resolve(lay)
    assert WireRange(0, 10).nbytes(lay) == lay.wire_nbytes(10)


def test_every_bundled_config_builds() -> None:
    for name, cfg in MODEL_CONFIGS.items():
        lay = KVLayout.from_hf_config(cfg)
        assert lay.bytes_per_token > 0, name
        assert lay.dtype is DType.BF16
