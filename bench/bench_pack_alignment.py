"""Where the wire buffer starts, and what runs beside the pack: the two
things docs/pack.md measures under ``kvbridge-bench pack``'s pack row.

* ``offsets``: the pack of one case of ``kvbridge-bench pack`` (its cache,
  block table and huge pages) into wire buffers that start 16, 32, 64 and
  4096 bytes past a huge page, each beside the core's memcpy of the same
  bytes into the same buffer, rounds interleaved, two threads.  numpy puts
  a large buffer 16 bytes past a page; ``kvbridge.pack.aligned_empty`` at a
  cache line.
* ``rotation``: the same pack and memcpy alone, then with the engine's torch
  code (the bench's torch baselines) and the unpack run between them, as
  the bench's rotation does.  ``OMP_WAIT_POLICY=passive`` in the
  environment tells torch's OpenMP threads to sleep when idle instead of
  spinning on the cores the pack then runs on.

    python bench/bench_pack_alignment.py [--case 'LBHNC 16'] [--rounds 12] [--mib 64]

Medians over the rounds, in GB/s.  Under pytest a short run checks that
every wire offset gets the same bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge_bench.cli import pack as bench

OFFSETS = (16, 32, 64, 4096)


def _setup(case_name: str, mib: float) -> tuple[Any, Any]:
    found = [c for c in bench.cases(False) if case_name in c.name]
    if not found:
        raise SystemExit(f"no case of kvbridge-bench pack is named like {case_name!r}")
    case = found[0]
    s = bench._setup_vllm(case, mib, 0) if case.vllm else bench._setup_native(case, mib, 0)
    copier_cache, copier = bench._contiguous_copier(s.wire.nbytes, 0)
    bench._page_backing(s, copier_cache, True)
    return s, copier


def _medians(fns: dict[str, Callable[[], Any]], rounds: int, nbytes: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: nbytes / float(np.median(v)) / 1e9 for k, v in times.items()}


def offset_wires(nbytes: int) -> dict[int, Any]:
    """Wire buffers of ``nbytes`` starting OFFSETS bytes past a huge page."""
    from kvbridge._pack.memory import HUGE_PAGE, advise_huge_pages
    from kvbridge.errors import Unavailable

    big = np.empty(nbytes + 2 * HUGE_PAGE + max(OFFSETS), np.uint8)
    try:
        advise_huge_pages(big)
    except Unavailable:
        pass  # no THP: the offsets still differ within a line
    big[:] = 1
    base = -big.ctypes.data % HUGE_PAGE
    return {m: big[base + m : base + m + nbytes] for m in OFFSETS}


def offsets(case_name: str, rounds: int, mib: float, threads: int = 2) -> dict[str, float]:
    s, copier = _setup(case_name, mib)
    fns: dict[str, Callable[[], Any]] = {}
    for m, w in offset_wires(s.wire.nbytes).items():
        fns[f"pack +{m}"] = lambda w=w: s.rng.pack(w, num_threads=threads)
        fns[f"memcpy +{m}"] = lambda w=w: copier.pack(w, num_threads=threads)
    return _medians(fns, rounds, s.wire.nbytes)


def rotation(
    case_name: str, rounds: int, mib: float, threads: int = 2
) -> dict[str, dict[str, float]]:
    import torch

    s, copier = _setup(case_name, mib)
    pack = lambda: s.rng.pack(s.wire, num_threads=threads)  # noqa: E731
    memcpy = lambda: copier.pack(s.wire, num_threads=threads)  # noqa: E731
    unpack = lambda: s.rng.unpack(s.wire, num_threads=threads)  # noqa: E731
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = _medians({"memcpy": memcpy, "pack": pack}, rounds, s.wire.nbytes)
        mixed = _medians(
            {
                "memcpy": memcpy,
                "pack": pack,
                "torch_pack": s.torch_pack,
                "unpack": unpack,
                "torch_unpack": s.torch_unpack,
            },
            rounds,
            s.wire.nbytes,
        )
    finally:
        torch.set_num_threads(prev)
    return {"alone": alone, "with torch": mixed}


def test_every_wire_offset_gets_the_same_bytes() -> None:
    s, _ = _setup("LBHNC 16", 1)
    want = np.asarray(s.rng.pack()).copy()
    for m, w in offset_wires(s.wire.nbytes).items():
        s.rng.pack(w, num_threads=2)
        assert bytes(w) == bytes(want), m
    print(offsets("LBHNC 16", 1, 1), rotation("LBHNC 16", 1, 1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", default="LBHNC 16", help="a case of kvbridge-bench pack (substring)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--mib", type=float, default=64)
    a = p.parse_args()
    print(f"# python bench/bench_pack_alignment.py {' '.join(sys.argv[1:])}")
    for k, v in offsets(a.case, a.rounds, a.mib).items():
        print(f"offsets   {k:12s} {v:5.1f} GB/s")
    for label, row in rotation(a.case, a.rounds, a.mib).items():
        print(f"rotation  {label:10s} " + "  ".join(f"{k} {v:5.1f}" for k, v in row.items()))
