"""What a KV sender spends per GB to prepare its chunks, by the length of
the runs its pages sit in: ``KVSource.views`` and the XXH3-64 streamed over
the runs (what the transport does for a source that lends its pages)
against the pack core's pack with its checksum in the copy into one reused
4 MiB buffer (what it does otherwise), one thread, CPU seconds per GB
(thread time), interleaved rounds; ``kvio.MIN_VIEW_RUN`` is where the two
meet.  The last row has 64 KiB pages in block-table order (the anchors'
pages at the sender: a 4 MiB chunk is one run).  The kernel's copy from the
runs or from the packed buffer is not part of it.

    python bench/bench_kv_views.py [--rounds 5] [--mib 64]

Under pytest a short run checks that both give the same checksums.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

CHUNK = 4 << 20
RUNS_KIB = (4, 8, 16, 32, 64, -64)  # negative: those pages in order


def _source(run_kib: int, mib: int) -> Any:
    from kvbridge import pack
    from kvbridge.layout import KVLayout
    from kvbridge.transport.tcp import kvio

    ordered, run_kib = run_kib < 0, abs(run_kib)
    heads = run_kib * 1024 // (16 * 128 * 2)  # 16-token pages of fp16 heads of 128
    lay = KVLayout(num_layers=1, num_kv_heads=heads, head_dim=128, dtype="fp16", page_tokens=16)
    npages = (mib << 20) // (run_kib * 1024 * 2)
    cache = pack.PagedKVCache.allocate(lay, npages, fill="random", seed=1)
    bt = np.arange(npages) if ordered else np.random.default_rng(0).permutation(npages)
    bt = bt.astype(np.int32)
    saved, kvio.MIN_VIEW_RUN = kvio.MIN_VIEW_RUN, 1  # lend runs of any length here
    try:
        return kvio.KVSource(cache, bt, 0, npages * 16, None)
    finally:
        kvio.MIN_VIEW_RUN = saved


def measure(
    rounds: int = 5, mib: int = 64, runs: tuple[int, ...] = RUNS_KIB
) -> list[dict[str, Any]]:
    from kvbridge.wire.chunk import checksum_parts

    out: list[dict[str, Any]] = []

    def body() -> None:
        for kib in runs:
            src = _source(kib, mib)
            buf = np.empty(CHUNK, np.uint8)
            grid = range(0, src.nbytes - CHUNK + 1, CHUNK)
            tv: list[float] = []
            tp: list[float] = []
            same = True
            for _ in range(rounds):
                t0 = time.thread_time()
                lent = [checksum_parts(src.views(off, CHUNK)) for off in grid]
                t1 = time.thread_time()
                packed = [
                    src.range.pack(buf, offset=off, nbytes=CHUNK, checksum=True, num_threads=1)[1]
                    for off in grid
                ]
                t2 = time.thread_time()
                same = same and lent == packed
                tv.append(t1 - t0)
                tp.append(t2 - t1)
            gb = len(grid) * CHUNK / 1e9
            ratios = [a / b for a, b in zip(tv, tp, strict=True)]
            out.append(
                {
                    "run_kib": kib,
                    "views_s_per_GB": statistics.median(tv) / gb,
                    "pack_s_per_GB": statistics.median(tp) / gb,
                    "ratio": (statistics.median(ratios), min(ratios), max(ratios)),
                    "same": same,
                }
            )

    th = threading.Thread(target=body)  # thread time of one thread, as a worker's
    th.start()
    th.join()
    return out


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = ["# one thread, 4 MiB chunks of shuffled pages; CPU seconds per GB (thread time)"]
    for r in rows:
        med, lo, hi = r["ratio"]
        kib = r["run_kib"]
        what = f"runs {kib:3d} KiB" if kib > 0 else f"{-kib} KiB pages in order"
        lines.append(
            f"{what:<22} views + xxh3 {r['views_s_per_GB']:.3f} s/GB  "
            f"pack + checksum {r['pack_s_per_GB']:.3f} s/GB  views / pack {med:.2f}x "
            f"({lo:.2f}-{hi:.2f})  checksums equal: {r['same']}"
        )
    return "\n".join(lines)


def test_views_and_pack_give_the_same_checksums() -> None:
    rows = measure(rounds=1, mib=8, runs=(8, 64))
    assert all(r["same"] for r in rows)
    print("\n" + format_rows(rows))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, default=64)
    a = p.parse_args()
    print(f"# python bench/bench_kv_views.py {' '.join(sys.argv[1:])}")
    print(format_rows(measure(a.rounds, a.mib)))
