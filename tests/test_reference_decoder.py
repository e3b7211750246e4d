"""The reference decoder: paged KV in every layout, extend == decode steps,
continuation from KV written by someone else, batching, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from kvbridge.errors import DTypeError, InvalidArgument, LayoutError, ResourceLimit
from kvbridge_bench.reference import DecoderConfig, Engine, ReferenceDecoder, SamplingParams, sample

CFG = DecoderConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=128,
    seed=3,
)
LAYOUTS = [
    (dtype, order, ho)
    for dtype in ("fp32", "bf16")
    for order in ("kv_first", "page_first")
    for ho in ("NHD", "HND")
]


def make(
    page_tokens: int = 8,
    dtype: str = "fp32",
    order: str = "kv_first",
    ho: str = "NHD",
    num_pages: int = 64,
) -> ReferenceDecoder:
    return ReferenceDecoder(
        CFG,
        CFG.kv_layout(dtype=dtype, page_tokens=page_tokens, order=order, head_order=ho),
        num_pages,
    )


def greedy_run(d: ReferenceDecoder, rid: int, prompt: list[int], n: int) -> list[int]:
    d.allocate(rid)
    logits = d.prefill({rid: prompt})[rid]
    out = []
    for i in range(n):
        tok = sample(logits, SamplingParams(), i)
        out.append(tok)
        logits = d.decode({rid: tok})[rid]
    return out


def test_is_an_engine() -> None:
    assert isinstance(make(), Engine)


@pytest.mark.parametrize(("dtype", "order", "ho"), LAYOUTS)
def test_extend_equals_decode_steps(dtype: str, order: str, ho: str) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(CFG.vocab_size) for _ in range(13)]
    a, b = make(5, dtype, order, ho), make(5, dtype, order, ho)
    toks = greedy_run(a, 1, prompt, 20)
    b.allocate(1)
    b.prefill({1: prompt})
    ext = b.extend(1, toks)
    # the same 20 tokens fed one by one on a fresh decoder
    c = make(5, dtype, order, ho)
    c.allocate(1)
    c.prefill({1: prompt})
    steps = torch.stack([c.decode({1: t})[1] for t in toks])
    tol = 1e-4 if dtype == "fp32" else 5e-2
    assert torch.allclose(ext, steps, atol=tol * 10, rtol=tol)
    kv_b, kv_c = b.read_kv(1, 0, 33), c.read_kv(1, 0, 33)
    assert torch.allclose(kv_b.float(), kv_c.float(), atol=tol, rtol=tol * 10)
    if dtype == "fp32":
        # greedy continuation from the extend equals the decode-step continuation
        assert [int(x) for x in ext.argmax(-1)[:-1]] == toks[1:]
        assert int(ext[-1].argmax()) == int(steps[-1].argmax())


@pytest.mark.parametrize(("dtype", "order", "ho"), LAYOUTS)
@pytest.mark.parametrize("dst_pt", [3, 16])
def test_continue_from_copied_pages(dtype: str, order: str, ho: str, dst_pt: int) -> None:
    rng = random.Random(dst_pt)
    prompt = [rng.randrange(CFG.vocab_size) for _ in range(21)]
    alone = greedy_run(make(8, dtype), 1, prompt, 16)
    # prefill on A (kv_first NHD, 8-token pages), copy pages into B (another layout)
    a = make(8, dtype)
    a.allocate(7)
    logits = a.prefill({7: prompt})[7]
    b = make(dst_pt, dtype, order, ho, num_pages=40)
    b.allocate(99)
    b.allocator.alloc(3)  # B's pages for the request are not A's page ids
    b.append_cached(99, prompt)
    b.write_kv(99, 0, a.read_kv(7, 0, len(prompt)))
    assert b.block_table(99) != a.block_table(7)
    out = []
    for i in range(16):
        tok = sample(logits, SamplingParams(), i)
        out.append(tok)
        logits = b.decode({99: tok})[99]
    assert out == alone


def test_batched_decode_matches_solo() -> None:
    rng = random.Random(5)
    prompts = {r: [rng.randrange(CFG.vocab_size) for _ in range(3 + 4 * r)] for r in range(1, 4)}
    solo = {r: greedy_run(make(), r, p, 10) for r, p in prompts.items()}
    d = make()
    for r in prompts:
        d.allocate(r)
    logits = d.prefill(prompts)
    out: dict[int, list[int]] = {r: [] for r in prompts}
    for i in range(10):
        step = {r: sample(logits[r], SamplingParams(), i) for r in prompts}
        for r, t in step.items():
            out[r].append(t)
        logits = d.decode(step)
    assert out == solo


def test_weights_deterministic_from_seed() -> None:
    p = [1, 2, 3, 4]
    assert greedy_run(make(), 1, p, 8) == greedy_run(make(), 1, p, 8)
    other = ReferenceDecoder(
        DecoderConfig(**{**CFG.__dict__, "seed": 4}), CFG.kv_layout(page_tokens=8), 16
    )
    assert greedy_run(other, 1, p, 8) != greedy_run(make(), 1, p, 8)


def test_pages_freed_and_cache_full() -> None:
    d = make(4, num_pages=4)
    d.allocate(1)
    d.prefill({1: list(range(10))})  # 3 pages
    assert d.allocator.free_count == 1
    d.allocate(2)
    with pytest.raises(ResourceLimit):
        d.prefill({2: list(range(9))})
    assert d.allocator.free_count == 1 and d.num_tokens(2) == 0  # nothing taken
    d.free(1)
    d.free(1)  # idempotent
    assert d.allocator.free_count == 4
    with pytest.raises(InvalidArgument):  # a double free
        d.allocator.free([0])


def test_bad_input_rejected() -> None:
    d = make()
    with pytest.raises(InvalidArgument):
        d.extend(1, [1])  # unknown request
    d.allocate(1)
    with pytest.raises(InvalidArgument):
        d.allocate(1)
    with pytest.raises(InvalidArgument):
        d.prefill({1: [CFG.vocab_size]})
    with pytest.raises(InvalidArgument):
        d.extend(1, [])
    assert d.num_tokens(1) == 0
    with pytest.raises(LayoutError):
        ReferenceDecoder(CFG, CFG.kv_layout().replace(head_dim=8), 4)
    with pytest.raises(DTypeError):
        ReferenceDecoder(CFG, CFG.kv_layout(dtype="fp8_e4m3"), 4)
    with pytest.raises(InvalidArgument):
        DecoderConfig(num_heads=6, num_kv_heads=4)
