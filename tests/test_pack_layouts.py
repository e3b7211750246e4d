"""Every pair of cache layouts, each as sender and as receiver, through the wire
layout: kvbridge's own orders (kv_first / page_first, NHD / HND, stacked), vLLM
0.32's per-layer views in all six physical orders (GPU backends' K|V split of the
last dimension, and the CPU backend's transposed-K tiles), SGLang 0.5.23's K and
V buffers (NHD token slots, HND pages), and MLA in each engine's form.  Tensors
are built exactly as the engines build them (kvbridge.testing.engine_caches);
token values are written where the engines' own writers put them, and the wire
must hold exactly those values; partial first and last blocks throughout."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvbridge.layout import KVLayout
from kvbridge.pack import HAS_CORE, PagedKVCache
from kvbridge.testing.engine_caches import (
    VLLM_LAYOUTS,
    read_sglang,
    read_vllm,
    sglang_mha_buffers,
    sglang_mla_buffers,
    vllm_kv_caches,
    write_sglang,
    write_vllm,
)
from kvbridge.testing.pack_ref import ref_pack, ref_unpack

pytestmark = pytest.mark.skipif(not HAS_CORE, reason="kvbridge._core is not built")

LAYERS, HEADS, DIM, DTYPE = 3, 2, 8, torch.bfloat16
START, END = 3, 40  # partial first and last blocks for every page size below


Values = tuple[torch.Tensor, torch.Tensor | None]  # k, v: [layers, tokens, heads, dim]


@dataclass
class Made:
    cache: PagedKVCache
    raw: list[torch.Tensor]  # every byte of the cache's memory, as flat uint8 tensors
    # Write / read token values at slot ids, the engine's own way (None for
    # kvbridge's own layouts, which have no engine).
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None
    read: Callable[[torch.Tensor], Values] | None = None


def _randomize(raw: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for r in raw:
        r.copy_(torch.randint(0, 256, r.shape, generator=g, dtype=torch.uint8))


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of ``t``'s storage."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _vllm(order: str, split: str, mla: bool, block: int, pages: int, seed: int) -> Made:
    caches = vllm_kv_caches(
        num_layers=LAYERS, num_blocks=pages, num_kv_heads=HEADS, block_size=block,
        head_size=DIM, dtype=DTYPE, layout=order, mla=mla,
    )  # fmt: skip
    base = _storage_bytes(caches[0])
    _randomize([base], seed)
    cache = PagedKVCache.from_vllm(caches, kv_split=split, mla=mla)

    def write(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        write_vllm(caches, slots, k, v, kv_split=split)

    def read(slots: torch.Tensor) -> Values:
        return read_vllm(caches, slots, DIM, mla=mla, kv_split=split)

    return Made(cache, [base], write, read)


def _sglang(hnd: bool, mla: bool, page: int, pages: int, seed: int) -> Made:
    size = pages * page - page  # the pool adds the padded page
    if mla:
        ks = sglang_mla_buffers(
            layer_num=LAYERS, size=size, page_size=page, kv_lora_rank=DIM - 2,
            qk_rope_head_dim=2, dtype=DTYPE,
        )  # fmt: skip
        vs = None
    else:
        ks, vs = sglang_mha_buffers(
            layer_num=LAYERS, size=size, page_size=page, head_num=HEADS, head_dim=DIM,
            dtype=DTYPE, hnd=hnd,
        )  # fmt: skip
    bases = list({b.data_ptr(): b for b in map(_storage_bytes, ks + (vs or []))}.values())
    _randomize(bases, seed)
    cache = PagedKVCache.from_sglang(ks, vs, page_size=page)

    def write(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        write_sglang(ks, vs, slots, k, v, page_size=page)

    def read(slots: torch.Tensor) -> Values:
        return read_sglang(ks, vs, slots, page_size=page)

    return Made(cache, bases, write, read)


def _native(
    order: str, head: str, stacked: bool, mla: bool, page: int, pages: int, seed: int
) -> Made:
    lay = KVLayout(
        num_layers=LAYERS, num_kv_heads=1 if mla else HEADS, head_dim=DIM, dtype="bf16",
        page_tokens=page, order=order, head_order="NHD" if mla else head, stacked=stacked, mla=mla,
    )  # fmt: skip
    cache = PagedKVCache.allocate(lay, pages, backend="torch", fill="random", seed=seed)
    arrays = [cache.tensors] if stacked else list(cache.tensors)
    return Made(cache, [a.view(torch.uint8).reshape(-1) for a in arrays])


def _vllm_kind(order: str, block: int) -> Callable[[int, int], Made]:
    return lambda pages, seed: _vllm(order, "last_dim", False, block, pages, seed)


KINDS: dict[str, Callable[[int, int], Made]] = {
    "kv_first-NHD": lambda p, s: _native("kv_first", "NHD", False, False, 4, p, s),
    "kv_first-HND-stacked": lambda p, s: _native("kv_first", "HND", True, False, 5, p, s),
    "page_first-NHD-stacked": lambda p, s: _native("page_first", "NHD", True, False, 8, p, s),
    "page_first-HND": lambda p, s: _native("page_first", "HND", False, False, 16, p, s),
    **{f"vllm-{o}": _vllm_kind(o, 4 + 4 * (i % 2)) for i, o in enumerate(VLLM_LAYOUTS)},
    "vllm-cpu-LBHNC": lambda p, s: _vllm("LBHNC", "cpu", False, 8, p, s),
    "sglang-NHD": lambda p, s: _sglang(False, False, 4, p, s),
    "sglang-HND": lambda p, s: _sglang(True, False, 16, p, s),
}
MLA_KINDS: dict[str, Callable[[int, int], Made]] = {
    "mla": lambda p, s: _native("kv_first", "NHD", False, True, 8, p, s),
    "vllm-mla-BLHNC": lambda p, s: _vllm("BLHNC", "last_dim", True, 4, p, s),
    "sglang-mla": lambda p, s: _sglang(False, True, 16, p, s),
}


def _table(cache: PagedKVCache, rng: random.Random) -> list[int]:
    need = -(-END // cache.block_tokens)
    ids = list(range(1, cache.num_pages))  # SGLang's page 0 is the padded page
    rng.shuffle(ids)
    return ids[:need]


def _values(mla: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    heads = 1 if mla else HEADS
    shape = (LAYERS, END - START, heads, DIM)
    k = torch.randn(shape, generator=g).to(DTYPE)
    return (k, None) if mla else (k, torch.randn(shape, generator=g).to(DTYPE))


def _expected_wire(k: torch.Tensor, v: torch.Tensor | None) -> np.ndarray:
    comps = [k] if v is None else [k, v]
    return torch.stack(comps, dim=1).contiguous().view(torch.uint8).reshape(-1).numpy()


def _slots(cache: PagedKVCache, table: list[int]) -> torch.Tensor:
    t = torch.arange(START, END)
    return (
        torch.tensor(table)[t // cache.block_tokens] * cache.layout.page_tokens
        + t % cache.layout.page_tokens
    )


def _cuts(total: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted({0, total, *(rng.randrange(total + 1) for _ in range(5))})
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _snapshot(made: Made) -> list[bytes]:
    return [r.numpy().tobytes() for r in made.raw]


def _as_values(wire: np.ndarray, mla: bool) -> Values:
    w = torch.from_numpy(wire.copy()).view(DTYPE)
    w = w.reshape(LAYERS, 1 if mla else 2, END - START, 1 if mla else HEADS, DIM)
    return w[:, 0], None if mla else w[:, 1]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def run_pair(send: Made, recv: Made, mla: bool, seed: int) -> None:
    rng = random.Random(seed)
    st, rt = _table(send.cache, rng), _table(recv.cache, rng)
    if send.write is not None:
        k, v = _values(mla, seed)
        send.write(_slots(send.cache, st), k, v)
        want = _expected_wire(k, v)
    else:
        want = ref_pack(send.cache, st, START, END).numpy()
    # The sender packs its range in uneven chunks through one validated range.
    out = send.cache.range(st, START, END, writable=False)
    assert out.nbytes == want.nbytes == send.cache.layout.wire_nbytes(END - START)
    wire = np.empty(out.nbytes, np.uint8)
    for a, b in _cuts(out.nbytes, rng):
        out.pack(wire[a:b], offset=a, nbytes=b - a)
    np.testing.assert_array_equal(wire, want)
    np.testing.assert_array_equal(ref_pack(send.cache, st, START, END).numpy(), want)
    # The receiver unpacks shuffled chunks.
    before = _snapshot(recv)
    into = recv.cache.range(rt, START, END)
    chunks = _cuts(into.nbytes, rng)
    rng.shuffle(chunks)
    for a, b in chunks:
        into.unpack(wire[a:b].copy(), offset=a)
    if recv.read is not None:  # the receiving engine reads the very values
        k2, v2 = recv.read(_slots(recv.cache, rt))
        kw, vw = _as_values(wire, mla)
        assert _same(k2, kw)
        assert v2 is None or (vw is not None and _same(v2, vw))
    # Every other byte stays as it was: the reference applied to the old bytes
    # gives exactly the new ones.
    after = _snapshot(recv)
    for r, b in zip(recv.raw, before, strict=True):
        r.copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
    ref_unpack(recv.cache, rt, START, END, wire)
    assert _snapshot(recv) == after


@pytest.mark.parametrize("recv", list(KINDS))
@pytest.mark.parametrize("send", list(KINDS))
def test_every_pair(send: str, recv: str) -> None:
    seed = hash((send, recv)) & 0xFFFF
    run_pair(KINDS[send](16, seed), KINDS[recv](16, seed + 1), False, seed)


@pytest.mark.parametrize("recv", list(MLA_KINDS))
@pytest.mark.parametrize("send", list(MLA_KINDS))
def test_every_mla_pair(send: str, recv: str) -> None:
    seed = hash((send, recv)) & 0xFFFF
    run_pair(MLA_KINDS[send](16, seed), MLA_KINDS[recv](16, seed + 1), True, seed)


def test_engine_values_land_where_the_engine_reads_them() -> None:
    """Independent of the reference: values written by vLLM's writer into a
    CPU-backend cache arrive, through the wire, at the slots where SGLang's
    writer would have put them (compared on SGLang's own buffers)."""
    rng = random.Random(5)
    send = _vllm("LBHNC", "cpu", False, 8, 16, 1)
    size, page = 15 * 4, 4
    ks, vs = sglang_mha_buffers(
        layer_num=LAYERS, size=size, page_size=page, head_num=HEADS, head_dim=DIM, dtype=DTYPE
    )
    recv = PagedKVCache.from_sglang(ks, vs, page_size=page)
    st, rt = _table(send.cache, rng), _table(recv, rng)
    k, v = _values(False, 9)
    send.write(_slots(send.cache, st), k, v)
    wire = send.cache.range(st, START, END).pack()
    recv.range(rt, START, END).unpack(wire)
    slots = _slots(recv, rt)
    for layer in range(LAYERS):
        assert torch.equal(ks[layer][slots].view(torch.int16), k[layer].view(torch.int16))
        assert torch.equal(vs[layer][slots].view(torch.int16), v[layer].view(torch.int16))
