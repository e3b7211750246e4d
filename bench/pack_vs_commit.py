"""Pack and unpack of two kvbridge source trees side by side, in one run.

    git worktree add --detach /tmp/kvb-base-pack main
    git worktree add --detach /tmp/kvb-new-pack HEAD
    (cd /tmp/kvb-base-pack && make inplace PY=$PWD/../.venv/bin/python)   # each tree, same Python
    python bench/pack_vs_commit.py --base /tmp/kvb-base-pack --new /tmp/kvb-new-pack

Each tree needs ``kvbridge/_core*.so`` built in place for the interpreter that
runs this script.  For every case of ``kvbridge-bench pack`` that both trees
have (the kvbridge layouts; the one-call ``pack`` / ``unpack`` API that both
share), the two trees run in alternating subprocesses (``python -S`` with the
tree first on the path, so an editable install does not shadow it; the order
flips every round).  Each subprocess times the median of several packs and
unpacks after a warm-up; the table prints new / base throughput, the median
over rounds (above 1: the new tree is faster), and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import time
from typing import Any

CASES = [
    "Llama-3-8B fp16",
    "Llama-3-8B bf16",
    "DeepSeek-V3 MLA bf16",
    "synthetic 2 KiB pages",
    "synthetic 4 KiB pages",
    "synthetic 16 KiB pages",
    "synthetic 64 KiB pages",
    "synthetic 256 KiB pages",
]


def _layout(name: str) -> Any:
    from kvbridge.layout import KVLayout

    if name.startswith("Llama-3-8B"):
        return KVLayout.for_model("llama-3-8b", dtype=name.split()[-1], page_tokens=16)
    if name.startswith("DeepSeek"):
        return KVLayout.for_model("deepseek-v3", page_tokens=64)
    kib = int(name.split()[1])
    return KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=kib // 2)


def worker(case: str, mib: float, reps: int, threads: int) -> dict[str, float]:
    import numpy as np
    import torch

    from kvbridge.pack import PagedKVCache, pack, unpack

    lay = _layout(case)
    pages = max(1, int(mib * (1 << 20)) // lay.bytes_per_page)
    tokens = pages * lay.page_tokens
    cache = PagedKVCache.allocate(lay, 2 * pages, backend="torch", fill="random", seed=0)
    bt = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(0))[:pages].numpy()
    bt = bt.astype(np.int32)
    wire = np.empty(lay.wire_nbytes(tokens), np.uint8)
    out: dict[str, float] = {}
    for name, fn in (
        ("pack", lambda: pack(cache, bt, 0, tokens, out=wire, num_threads=threads)),
        ("unpack", lambda: unpack(cache, bt, 0, tokens, wire, num_threads=threads)),
    ):
        fn()
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = wire.nbytes / statistics.median(times) / 1e9
    return out


def run_tree(tree: str, case: str, mib: float, reps: int, threads: int) -> dict[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tree, *site.getsitepackages()])
    cmd = [sys.executable, "-S", os.path.abspath(__file__), "--worker", case]
    cmd += ["--mib", str(mib), "--reps", str(reps), "--threads", str(threads)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", help="the baseline tree")
    ap.add_argument("--new", help="the tree under test")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mib", type=float, default=32.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="pack threads (0: automatic)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.mib, args.reps, args.threads)))
        return 0
    if not args.base or not args.new:
        ap.error("--base and --new are required")
    print(
        f"{'case':<26}{'pack new/base':>15}{'(min-max)':>14}{'unpack new/base':>17}{'(min-max)':>14}"
    )
    for case in CASES:
        ratios: dict[str, list[float]] = {"pack": [], "unpack": []}
        for r in range(args.rounds):
            order = [("base", args.base), ("new", args.new)]
            if r % 2:
                order.reverse()
            got = {k: run_tree(t, case, args.mib, args.reps, args.threads) for k, t in order}
            for op in ratios:
                ratios[op].append(got["new"][op] / got["base"][op])
        line = f"{case:<26}"
        for op, width in (("pack", 15), ("unpack", 17)):
            v = ratios[op]
            line += f"{statistics.median(v):>{width}.3f}{f'({min(v):.2f}-{max(v):.2f})':>14}"
        print(line, flush=True)
    print(f"{args.rounds} rounds, alternating order; each figure the median of {args.reps} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
