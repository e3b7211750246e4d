"""Pack and unpack bandwidth for real KV layouts and synthetic page sizes.

Each case is measured against baselines in the same run, all on the same
number of threads N (``--threads``, default the core's automatic count,
``min(cores, 8)``):

- memcpy of the same bytes: on N threads (the core's own thread pool copying
  one contiguous run, split as a pack is split) and on one thread (numpy
  ``copyto``); the ratio is against the faster of the two;
- the torch code an engine would write today, with ``torch.set_num_threads(N)``:
  one ``index_select`` (pack) or ``index_copy_`` (unpack) per layer and K/V
  for kvbridge's kv_first pages, and for vLLM's per-layer views a block gather
  then a permuting copy into the wire order.

A second table compares the checksum in the copy with packing first and
hashing after (same bytes, one thread each: a checksummed slice is copied by
one thread): 4 MiB chunks of each case, XXH3-64 by the pack core and by the
``xxhash`` package.  The variants of a case run interleaved, round-robin,
after warm-up; each figure is the median of the repeated runs.  Ratios above 1
mean kvbridge is faster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError, LayoutError, Unavailable
from kvbridge.layout import DType, KVLayout

from .output import emit_json

KIB = 1024
MIB = 1024 * 1024
CHUNK = 4 * MIB  # the checksum table's chunk (the TCP sender's default chunk order)

# Targets (docs/pack.md): x memcpy by page size, and never slower than torch.
TARGET_LARGE = 0.8  # pages >= 16 KiB
TARGET_SMALL = 0.6  # smaller pages
TARGET_VLLM = 0.8  # vLLM LBHNC, 16-token blocks of SmolLM2 (issue 12)

SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_size": 64}


@dataclass(frozen=True)
class Case:
    name: str
    layout: KVLayout | None = None  # kvbridge's own layout, or
    vllm: dict[str, Any] = field(default_factory=dict)  # a vLLM cache (engine_caches args)
    target: float | None = None

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer and one component (one copy run)."""
        if self.layout is not None:
            return self.layout.page_bytes_per_layer // self.layout.num_components
        v = self.vllm
        return int(v["block_size"] * v["num_kv_heads"] * v["head_size"] * 2)


def cases(quick: bool) -> list[Case]:
    out = [
        Case("Llama-3-8B fp16", KVLayout.for_model("llama-3-8b", dtype="fp16", page_tokens=16)),
        Case("Llama-3-8B bf16", KVLayout.for_model("llama-3-8b", dtype="bf16", page_tokens=16)),
        Case("DeepSeek-V3 MLA bf16", KVLayout.for_model("deepseek-v3", page_tokens=64)),
    ]
    # vLLM's own tensors, SmolLM2's shape (3 KV heads x 64, bf16): the GPU
    # backends' LBHNC at 16-token blocks, a block-outer order at 64, and the
    # CPU backend's LBHNC at 32 (K stored transposed in each block).
    out += [
        Case("vLLM LBHNC 16 SmolLM2", vllm={**SMOLLM2, "block_size": 16, "layout": "LBHNC"},
             target=TARGET_VLLM),
        Case("vLLM BLNHC 64 SmolLM2", vllm={**SMOLLM2, "block_size": 64, "layout": "BLNHC"}),
        Case("vLLM-CPU LBHNC 32 SmolLM2",
             vllm={**SMOLLM2, "block_size": 32, "layout": "LBHNC", "kv_split": "cpu"}),
    ]  # fmt: skip
    # Synthetic: 4 layers of 8 heads x 128 fp16 (2 KiB per token and component).
    sizes = [2, 16, 256] if quick else [2, 4, 16, 64, 256]
    for kib in sizes:
        lay = KVLayout(
            num_layers=4, num_kv_heads=8, head_dim=128, dtype=DType.FP16, page_tokens=kib // 2
        )
        out.append(Case(f"synthetic {kib} KiB pages", lay))
    return out


def default_threads() -> int:
    """The core's automatic thread count: min(cores, 8)."""
    return max(1, min(os.cpu_count() or 1, 8))


def _median_interleaved(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int, tick: Callable[[], None]
) -> dict[str, float]:
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(reps):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
        tick()
    return {k: float(np.median(v)) for k, v in times.items()}


def _contiguous_copier(nbytes: int, seed: int) -> tuple[Any, Any]:
    """A cache that is one contiguous run of ``nbytes`` bytes and its range: its
    pack is a memcpy of those bytes on the core's threads."""
    from kvbridge.pack import PagedKVCache

    unit = 4096
    while nbytes % unit:
        unit //= 2
    tokens = nbytes // unit
    lay = KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=unit,
        dtype=DType.FP8_E4M3,
        page_tokens=tokens,
        mla=True,
    )
    src = PagedKVCache.allocate(lay, 1, fill="random", seed=seed)
    return src, src.range([0], 0, tokens, writable=False)


def _page_backing(s: Setup, copier_cache: Any, advise: bool) -> dict[str, float]:
    """With ``advise``, ask for huge pages on every buffer of the case (the
    engine's cache, the memcpy's source, the wire, the unpack's source), so
    that pack and memcpy read memory of the same page size; then the share
    of each on huge pages.  Without it each buffer stays as its allocator
    left it: torch's (a vLLM cache) on 4 KiB pages where THP is
    ``madvise``, numpy's (the memcpy's source, the wire) on huge pages,
    since numpy asks for them."""
    from kvbridge.pack import advise_huge_pages, huge_page_bytes

    caches = {"cache": s.cache, "memcpy_src": copier_cache}
    arrays = {"wire": s.wire, "unpack_src": s.src}
    if advise:
        try:
            for c in caches.values():
                c.advise_huge_pages()
            for a in arrays.values():
                advise_huge_pages(a)
        except Unavailable:
            pass  # no THP here: the shares below say so
    share = {k: c.huge_page_bytes() / max(1, c.memory_nbytes()) for k, c in caches.items()}
    share.update({k: huge_page_bytes(a) / max(1, a.nbytes) for k, a in arrays.items()})
    return share


@dataclass
class Setup:
    """One case's caches, block tables, buffers and the torch baselines."""

    cache: Any
    rng: Any  # the KVRange of the measured request
    wire: np.ndarray[Any, Any]
    src: np.ndarray[Any, Any]
    torch_pack: Callable[[], Any]
    torch_unpack: Callable[[], Any]


def _wire_buffers(nbytes: int, seed: int) -> tuple[Any, Any]:
    """The wire buffer the pack writes (and memcpy too) and the random bytes
    the unpack reads (and the 1-thread memcpy copies), each starting at a
    cache line as kvbridge's own wire buffers do (``aligned_empty``)."""
    from kvbridge.pack import aligned_empty

    src = aligned_empty(nbytes)
    src[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return aligned_empty(nbytes), src


def _setup_native(case: Case, wire_mib: float, seed: int) -> Setup:
    import torch

    from kvbridge.pack import PagedKVCache

    lay = case.layout
    assert lay is not None
    pt = lay.page_tokens
    pages = max(1, int(wire_mib * MIB) // lay.bytes_per_page)
    tokens = pages * pt
    pool = 2 * pages
    cache = PagedKVCache.allocate(lay, pool, backend="torch", fill="random", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(pool, generator=gen)[:pages]
    bt = idx.numpy().astype(np.int32)
    wire, src = _wire_buffers(lay.wire_nbytes(tokens), seed)
    # The engine's torch code: per layer and per K/V, whole pages.
    comps = lay.num_components
    page_elems = case.page_bytes // lay.itemsize
    dtype = cache.layer_views()[0].dtype
    wire_t = torch.from_numpy(wire).view(dtype).view(lay.num_layers, comps, pages, page_elems)
    views = [v.view(comps, pool, page_elems) for v in _component_first(lay, cache)]

    def torch_pack() -> None:
        for layer, v in enumerate(views):
            for c in range(comps):
                torch.index_select(v[c], 0, idx, out=wire_t[layer, c])

    def torch_unpack() -> None:
        for layer, v in enumerate(views):
            for c in range(comps):
                v[c].index_copy_(0, idx, wire_t[layer, c])

    return Setup(cache, cache.range(bt, 0, tokens), wire, src, torch_pack, torch_unpack)


def _setup_vllm(case: Case, wire_mib: float, seed: int) -> Setup:
    import torch

    from kvbridge.pack import PagedKVCache
    from kvbridge.testing.engine_caches import vllm_kv_caches

    v = case.vllm
    L, H, D, bs = v["num_layers"], v["num_kv_heads"], v["head_size"], v["block_size"]
    split = v.get("kv_split", "last_dim")
    per_block = L * 2 * H * bs * D * 2
    blocks = max(1, int(wire_mib * MIB) // per_block)
    pool = 2 * blocks
    caches = vllm_kv_caches(
        num_layers=L, num_blocks=pool, num_kv_heads=H, block_size=bs, head_size=D,
        dtype=torch.bfloat16, layout=v["layout"],
    )  # fmt: skip
    flat = torch.empty(0, dtype=torch.uint8).set_(caches[0].untyped_storage())
    gen = torch.Generator().manual_seed(seed)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))
    # the CPU backend's vec kernels' layout, whatever kernels this CPU would get
    cache = PagedKVCache.from_vllm(
        caches, kv_split=split, cpu_isa="vec" if split == "cpu" else None
    )
    idx = torch.randperm(pool, generator=gen)[:blocks]
    bt = idx.numpy().astype(np.int32)
    tokens = blocks * bs
    wire, src = _wire_buffers(cache.layout.wire_nbytes(tokens), seed)
    wire_t = torch.from_numpy(wire).view(torch.bfloat16).view(L, 2, blocks, bs, H, D)

    # The engine's torch code: gather the blocks, then one permuting copy into
    # the wire order (K and V split as the backend splits them).
    def kv_views(kv: Any) -> tuple[Any, Any]:
        if split == "cpu":  # [n, H, bs, 2D] -> K [n, H, D, bs], V [n, H, bs, D]
            n = kv.shape[0]
            key, value = kv.view(n, H, 2 * bs, D).chunk(2, dim=2)
            return key.view(n, H, D, bs).permute(0, 3, 1, 2), value.permute(0, 2, 1, 3)
        return kv[..., :D].permute(0, 2, 1, 3), kv[..., D:].permute(0, 2, 1, 3)

    def torch_pack() -> None:
        for layer, kv in enumerate(caches):
            k, val = kv_views(torch.index_select(kv, 0, idx))  # [n, bs, H, D] views
            wire_t[layer, 0].copy_(k)
            wire_t[layer, 1].copy_(val)

    def torch_unpack() -> None:
        for layer, kv in enumerate(caches):
            block = torch.empty((blocks, *kv.shape[1:]), dtype=kv.dtype)
            k, val = kv_views(block)
            k.copy_(wire_t[layer, 0])
            val.copy_(wire_t[layer, 1])
            kv.index_copy_(0, idx, block)

    return Setup(cache, cache.range(bt, 0, tokens), wire, src, torch_pack, torch_unpack)


def measure(
    case: Case,
    wire_mib: float,
    reps: int,
    warmup: int,
    num_threads: int,
    tick: Callable[[], None],
    seed: int = 0,
    huge_pages: bool = True,
) -> dict[str, Any]:
    """Time one case; return its row (seconds, GB/s and ratios)."""
    import torch

    n = num_threads or default_threads()
    s = _setup_vllm(case, wire_mib, seed) if case.vllm else _setup_native(case, wire_mib, seed)
    copier_cache, copier = _contiguous_copier(s.wire.nbytes, seed)
    assert copier.nbytes == s.wire.nbytes
    backing = _page_backing(s, copier_cache, huge_pages)
    fns: dict[str, Callable[[], Any]] = {
        "memcpy_1": lambda: np.copyto(s.wire, s.src),
        "memcpy_n": lambda: copier.pack(s.wire, num_threads=n),
        "pack": lambda: s.rng.pack(s.wire, num_threads=n),
        "torch_pack": s.torch_pack,
        "unpack": lambda: s.rng.unpack(s.wire, num_threads=n),
        "torch_unpack": s.torch_unpack,
    }
    # kvbridge and the torch code must agree before they are timed.
    s.rng.pack(s.wire, num_threads=n)
    check = s.wire.copy()
    s.torch_pack()
    if not np.array_equal(s.wire, check):
        raise KVBridgeError(f"{case.name}: kvbridge pack and the torch code disagree")
    copier.pack(s.wire, num_threads=n)
    np.copyto(s.wire, check)
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        t = _median_interleaved(fns, reps, warmup, tick)
    finally:
        torch.set_num_threads(prev)
    gbs = {k: s.wire.nbytes / v / 1e9 for k, v in t.items()}
    best_memcpy = min(t["memcpy_1"], t["memcpy_n"])
    target = case.target or (TARGET_LARGE if case.page_bytes >= 16 * KIB else TARGET_SMALL)
    ratios = {
        "pack_vs_memcpy": best_memcpy / t["pack"],
        "pack_vs_torch": t["torch_pack"] / t["pack"],
        "unpack_vs_memcpy": best_memcpy / t["unpack"],
        "unpack_vs_torch": t["torch_unpack"] / t["unpack"],
    }
    meets = (
        min(ratios["pack_vs_memcpy"], ratios["unpack_vs_memcpy"]) >= target
        and min(ratios["pack_vs_torch"], ratios["unpack_vs_torch"]) >= 1.0
    )
    return {
        "case": case.name,
        "page_bytes": case.page_bytes,
        "wire_bytes": int(s.wire.nbytes),
        "tokens": int(s.rng.end),
        "threads": n,
        "huge_pages": backing,
        "seconds": t,
        "gb_per_s": gbs,
        **ratios,
        "target_vs_memcpy": target,
        "meets_targets": meets,
    }


def measure_checksum(
    case: Case, wire_mib: float, reps: int, warmup: int, tick: Callable[[], None], seed: int = 0
) -> dict[str, Any]:
    """Pack + XXH3-64 in one pass against pack then hash (one thread each),
    4 MiB chunks of the case's request."""
    import xxhash

    from kvbridge.pack import xxh3_64

    s = _setup_vllm(case, wire_mib, seed) if case.vllm else _setup_native(case, wire_mib, seed)
    rng, wire = s.rng, s.wire
    chunks = [(off, min(CHUNK, rng.nbytes - off)) for off in range(0, rng.nbytes, CHUNK)]

    def fused() -> None:
        for off, n in chunks:
            rng.pack(wire[off : off + n], offset=off, nbytes=n, checksum=True)

    def then_core() -> None:
        for off, n in chunks:
            rng.pack(wire[off : off + n], offset=off, nbytes=n, num_threads=1)
            xxh3_64(wire[off : off + n])

    def then_xxhash() -> None:
        for off, n in chunks:
            rng.pack(wire[off : off + n], offset=off, nbytes=n, num_threads=1)
            xxhash.xxh3_64_intdigest(wire[off : off + n].data)

    def pack_only() -> None:
        for off, n in chunks:
            rng.pack(wire[off : off + n], offset=off, nbytes=n, num_threads=1)

    off, n = chunks[0]
    _, digest = rng.pack(wire[off : off + n], offset=off, nbytes=n, checksum=True)
    if digest != xxhash.xxh3_64_intdigest(wire[off : off + n].data):
        raise KVBridgeError(f"{case.name}: the checksum in the copy differs from xxhash's")
    fns = {"fused": fused, "then_core": then_core, "then_xxhash": then_xxhash, "pack": pack_only}
    t = _median_interleaved(fns, reps, warmup, tick)
    return {
        "case": case.name,
        "wire_bytes": int(wire.nbytes),
        "seconds": t,
        "gb_per_s": {k: wire.nbytes / v / 1e9 for k, v in t.items()},
        "fused_vs_pack_then_core_xxh3": t["then_core"] / t["fused"],
        "fused_vs_pack_then_xxhash": t["then_xxhash"] / t["fused"],
        "fused_vs_pack_alone": t["pack"] / t["fused"],
    }


def _component_first(lay: KVLayout, cache: Any) -> list[Any]:
    """Per-layer views whose first axis is the component (what the torch code indexes)."""
    views: list[Any] = cache.layer_views()
    if lay.mla:
        return [v.unsqueeze(0) for v in views]
    if lay.order.value != "kv_first" or lay.head_order.value != "NHD":
        # Page copies of other orders would not produce the wire layout.
        raise LayoutError("the torch baseline here is written for kv_first NHD caches")
    return views


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer cases, less data, fewer reps")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--mib", type=float, default=None, help="wire MiB per case (default 64)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per variant (9)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads of pack, memcpy and torch (0: min(cores, 8))",
    )
    parser.add_argument("--cases", default="", help="only cases whose name contains this")
    parser.add_argument("--no-checksum", action="store_true", help="skip the checksum table")
    parser.add_argument(
        "--as-allocated",
        action="store_true",
        help="leave each buffer on the pages its allocator gave it (default: ask for huge "
        "pages on every buffer, so that pack and memcpy read the same page size)",
    )


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'case':<27}{'page':>9}{'wire':>9}{'mcpy 1':>8}{'mcpy N':>8}{'pack':>7}{'x mcpy':>8}"
        f"{'x torch':>8}{'unpack':>8}{'x mcpy':>8}{'x torch':>8}{'huge %':>9}  target"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        g = r["gb_per_s"]
        lines.append(
            f"{r['case']:<27}{r['page_bytes'] // KIB:>6} KiB{r['wire_bytes'] / MIB:>5.0f} MiB"
            f"{g['memcpy_1']:>8.1f}{g['memcpy_n']:>8.1f}{g['pack']:>7.1f}{r['pack_vs_memcpy']:>8.2f}"
            f"{r['pack_vs_torch']:>8.2f}{g['unpack']:>8.1f}{r['unpack_vs_memcpy']:>8.2f}"
            f"{r['unpack_vs_torch']:>8.2f}{_huge_cell(r['huge_pages']):>9}"
            f"  {'ok' if r['meets_targets'] else 'MISS'}"
            f" (>= {r['target_vs_memcpy']}x memcpy)"
        )
    threads = sorted({r["threads"] for r in rows})
    lines.append(
        f"GB/s columns: median bandwidth, N = {','.join(map(str, threads))} threads for pack, "
        "memcpy N and torch; x mcpy: kvbridge over the faster memcpy; x torch: over torch; "
        "huge %: share of the engine's cache / of the memcpy's source on huge pages."
    )
    return "\n".join(lines)


def _huge_cell(share: dict[str, float]) -> str:
    return f"{100 * share['cache']:.0f}/{100 * share['memcpy_src']:.0f}"


def format_checksum_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'case (4 MiB chunks, 1 thread)':<31}{'fused':>8}{'pack':>8}{'+xxh3':>8}{'+xxhash':>9}"
        f"{'x +xxh3':>9}{'x +xxhash':>11}{'x pack':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        g = r["gb_per_s"]
        lines.append(
            f"{r['case']:<31}{g['fused']:>8.1f}{g['pack']:>8.1f}{g['then_core']:>8.1f}"
            f"{g['then_xxhash']:>9.1f}{r['fused_vs_pack_then_core_xxh3']:>9.2f}"
            f"{r['fused_vs_pack_then_xxhash']:>11.2f}{r['fused_vs_pack_alone']:>8.2f}"
        )
    lines.append(
        "GB/s columns: fused = pack computing XXH3-64 in the same pass; pack = pack alone; "
        "+xxh3 / +xxhash = pack, then hash with the core's XXH3-64 / the xxhash package. "
        "x columns: fused over each (x pack < 1 is the hash's cost)."
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvbridge.pack import HAS_CORE

    if not HAS_CORE:
        print("kvbridge._core is not built: run `make build` first", file=sys.stderr)
        return 2
    mib = args.mib if args.mib is not None else (16.0 if args.quick else 64.0)
    reps = args.reps if args.reps is not None else (5 if args.quick else 9)
    todo = [c for c in cases(args.quick) if args.cases.lower() in c.name.lower()]
    sums = (
        []
        if args.no_checksum
        else [c for c in todo if c.name.startswith(("Llama-3-8B bf16", "vLLM"))]
    )
    rows, checks = [], []
    total = (len(todo) + len(sums)) * reps
    with tqdm(total=total, desc="pack bench", unit="rep", file=sys.stderr) as bar:
        for case in todo:
            bar.set_postfix_str(case.name)
            rows.append(
                measure(
                    case, mib, reps, args.warmup, args.threads, lambda: bar.update(1),
                    huge_pages=not args.as_allocated,
                )
            )  # fmt: skip
        for case in sums:
            bar.set_postfix_str(f"{case.name} checksum")
            checks.append(measure_checksum(case, mib, reps, args.warmup, lambda: bar.update(1)))
    if args.json:
        emit_json({"rows": rows, "checksum": checks}, indent=2)
    else:
        print(format_table(rows))
        if checks:
            print()
            print(format_checksum_table(checks))
    return 0
