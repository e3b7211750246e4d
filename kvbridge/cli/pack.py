"""Pack and unpack bandwidth for real KV layouts and synthetic page sizes.

Each case is measured against two baselines in the same run: a memcpy of the
same number of bytes (numpy ``copyto`` of one contiguous buffer into another)
and the torch code an engine would write today (one ``index_select`` for pack,
one ``index_copy_`` for unpack, per layer and per K/V, straight into or out of
the wire buffer).  The variants of a case run interleaved, round-robin, after
warm-up; each figure is the median of the repeated runs.  Ratios above 1 mean
kvbridge is faster.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import KVBridgeError, LayoutError
from ..layout import DType, KVLayout

KIB = 1024
MIB = 1024 * 1024

# Targets on the reference machine (docs/pack.md): x memcpy by page size, and
# never slower than torch.
TARGET_LARGE = 0.8  # pages >= 16 KiB
TARGET_SMALL = 0.6  # smaller pages


@dataclass(frozen=True)
class Case:
    name: str
    layout: KVLayout

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer and one component (one copy run)."""
        return self.layout.page_bytes_per_layer // self.layout.num_components


def cases(quick: bool) -> list[Case]:
    out = [
        Case("Llama-3-8B fp16", KVLayout.for_model("llama-3-8b", dtype="fp16", page_tokens=16)),
        Case("Llama-3-8B bf16", KVLayout.for_model("llama-3-8b", dtype="bf16", page_tokens=16)),
        Case("DeepSeek-V3 MLA bf16", KVLayout.for_model("deepseek-v3", page_tokens=64)),
    ]
    # Synthetic: 4 layers of 8 heads x 128 fp16 (2 KiB per token and component).
    sizes = [2, 16, 256] if quick else [2, 4, 16, 64, 256]
    for kib in sizes:
        lay = KVLayout(
            num_layers=4, num_kv_heads=8, head_dim=128, dtype=DType.FP16, page_tokens=kib // 2
        )
        out.append(Case(f"synthetic {kib} KiB pages", lay))
    return out


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


def measure(
    case: Case,
    wire_mib: float,
    reps: int,
    warmup: int,
    num_threads: int,
    tick: Callable[[], None],
    seed: int = 0,
) -> dict[str, Any]:
    """Time one case; return its row (seconds, GB/s and ratios)."""
    import torch

    from ..pack import PagedKVCache, pack, unpack

    lay = case.layout
    pt = lay.page_tokens
    pages = max(1, int(wire_mib * MIB) // lay.bytes_per_page)
    tokens = pages * pt
    pool = 2 * pages
    cache = PagedKVCache.allocate(lay, pool, backend="torch", fill="random", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(pool, generator=gen)[:pages]
    bt = idx.numpy().astype(np.int32)
    wire = np.empty(lay.wire_nbytes(tokens), np.uint8)
    src = np.random.default_rng(seed).integers(0, 256, wire.nbytes, dtype=np.uint8)

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

    fns: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: np.copyto(wire, src),
        "pack": lambda: pack(cache, bt, 0, tokens, out=wire, num_threads=num_threads),
        "torch_pack": torch_pack,
        "unpack": lambda: unpack(cache, bt, 0, tokens, wire, num_threads=num_threads),
        "torch_unpack": torch_unpack,
    }
    # Both paths must agree before they are timed.
    pack(cache, bt, 0, tokens, out=wire)
    check = wire.copy()
    torch_pack()
    if not np.array_equal(wire, check):
        raise KVBridgeError(f"{case.name}: kvbridge pack and the torch code disagree")
    t = _median_interleaved(fns, reps, warmup, tick)
    gbs = {k: wire.nbytes / v / 1e9 for k, v in t.items()}
    target = TARGET_LARGE if case.page_bytes >= 16 * KIB else TARGET_SMALL
    ratios = {
        "pack_vs_memcpy": t["memcpy"] / t["pack"],
        "pack_vs_torch": t["torch_pack"] / t["pack"],
        "unpack_vs_memcpy": t["memcpy"] / t["unpack"],
        "unpack_vs_torch": t["torch_unpack"] / t["unpack"],
    }
    meets = (
        min(ratios["pack_vs_memcpy"], ratios["unpack_vs_memcpy"]) >= target
        and min(ratios["pack_vs_torch"], ratios["unpack_vs_torch"]) >= 1.0
    )
    row: dict[str, Any] = {
        "case": case.name,
        "page_bytes": case.page_bytes,
        "wire_bytes": int(wire.nbytes),
        "tokens": tokens,
        "seconds": t,
        "gb_per_s": gbs,
        **ratios,
        "target_vs_memcpy": target,
        "meets_targets": meets,
    }
    return row


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
    parser.add_argument("--threads", type=int, default=0, help="kvbridge CPU threads (0 = auto)")


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'case':<26}{'page':>9}{'wire':>9}{'memcpy':>9}{'pack':>9}{'x mcpy':>8}{'x torch':>9}"
        f"{'unpack':>9}{'x mcpy':>8}{'x torch':>9}  target"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        g = r["gb_per_s"]
        lines.append(
            f"{r['case']:<26}{r['page_bytes'] // KIB:>6} KiB{r['wire_bytes'] / MIB:>5.0f} MiB"
            f"{g['memcpy']:>9.1f}{g['pack']:>9.1f}{r['pack_vs_memcpy']:>8.2f}"
            f"{r['pack_vs_torch']:>9.2f}{g['unpack']:>9.1f}{r['unpack_vs_memcpy']:>8.2f}"
            f"{r['unpack_vs_torch']:>9.2f}  {'ok' if r['meets_targets'] else 'MISS'}"
            f" (>= {r['target_vs_memcpy']}x memcpy)"
        )
    lines.append(
        "GB/s columns: median bandwidth; x mcpy / x torch: kvbridge speed over the baseline."
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..pack import HAS_CORE

    if not HAS_CORE:
        print("kvbridge._core is not built: run `make build` first", file=sys.stderr)
        return 2
    mib = args.mib if args.mib is not None else (16.0 if args.quick else 64.0)
    reps = args.reps if args.reps is not None else (5 if args.quick else 9)
    todo = cases(args.quick)
    rows = []
    with tqdm(total=len(todo) * reps, desc="pack bench", unit="rep", file=sys.stderr) as bar:
        for case in todo:
            bar.set_postfix_str(case.name)
            rows.append(measure(case, mib, reps, args.warmup, args.threads, lambda: bar.update(1)))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
    return 0
