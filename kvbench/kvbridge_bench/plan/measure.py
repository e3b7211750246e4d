"""Measure the reference engine's step times (the demo's engine, the real
SmolLM2-135M weights) for the simulator's demo parameter file.

Run as ``python -m kvbridge_bench.plan.measure`` on the machine whose demo
run the simulator is compared with: one torch thread on one CPU, as each of
the demo's engine workers computes (``DemoConfig.role_cpus``).  It prints
the fitted coefficients of

- prefill / extend: ``a + b * n + c * n * (ctx + n / 2)`` seconds for ``n``
  new tokens after ``ctx`` cached ones (one request per pass);
- decode step: ``d0 + d1 * batch + d2 * sum(ctx)`` seconds for one token of
  each of ``batch`` requests,

each the least CPU time of repeated passes (``time.thread_time`` of the
computing thread: on a machine shared with other jobs the wall time also
counts the time the thread waited for its CPU, which an engine with an
accelerator of its own does not), and the raw timings (JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np


def _min_time(fn: Any, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return min(ts)


def measure(repeats: int = 7, cpu: int | None = 0) -> dict[str, Any]:
    import torch

    from ..demo.config import DemoConfig
    from ..demo.engines import make_engine
    from ..reference.model_file import prepare_model

    torch.set_num_threads(1)
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    cfg = DemoConfig(model_dir=str(prepare_model()))
    layout = cfg.p_layout()
    eng = make_engine(cfg, layout, 2048)
    vocab = cfg.decoder_config().vocab_size
    rng = np.random.default_rng(0)
    rid = [0]

    def toks(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, n)]

    def fresh(ctx: int) -> int:
        rid[0] += 1
        eng.allocate(rid[0])
        if ctx:
            eng.forward({rid[0]: toks(ctx)}, last_only=True)
        return rid[0]

    prefill: list[tuple[int, int, float]] = []  # (n, ctx, seconds)
    for ctx in (0, 480, 960):
        base = fresh(ctx)
        for n in (1, 8, 32, 64, 128, 256):
            if ctx + n > 1536:
                continue
            samples = []
            for _ in range(repeats):
                rid[0] += 1
                r = rid[0]
                eng.allocate(r)
                if ctx:
                    eng.adopt(r, eng.tokens(base), eng.block_table(base))
                t = toks(n)
                t0 = time.thread_time()
                eng.forward({r: t}, last_only=True)
                samples.append(time.thread_time() - t0)
                eng.free(r)
            prefill.append((n, ctx, min(samples)))
    decode: list[tuple[int, int, float]] = []  # (batch, sum ctx, seconds)
    for ctx in (256, 960):
        for b in (1, 2, 4, 8):
            rs = [fresh(ctx) for _ in range(b)]
            secs = _min_time(
                lambda rs=rs: eng.forward({r: toks(1) for r in rs}, last_only=True), repeats
            )
            decode.append((b, b * ctx, secs))
            for r in rs:
                eng.free(r)
    out = fit(prefill, decode)
    out.update(
        {
            "raw_prefill": prefill,
            "raw_decode": decode,
            "torch": torch.__version__,
            "repeats": repeats,
        }
    )
    return out


def _nonneg_lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a term whose coefficient
    comes out negative (noise) is dropped and the rest refitted."""
    keep = list(range(len(rows[0])))
    while True:
        a = np.array([[r[i] for i in keep] for r in rows])
        coef = np.linalg.lstsq(a, np.array(y), rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * len(rows[0])
            for i, c in zip(keep, coef, strict=True):
                out[i] = max(0.0, float(c))
            return out
        keep.pop(int(np.argmin(coef)))


def fit(prefill: list[Any], decode: list[Any]) -> dict[str, Any]:
    """The coefficients of the module text from raw ``(n, ctx, s)`` and
    ``(batch, sum_ctx, s)`` timings (non-negative least squares)."""
    pf = _nonneg_lstsq([[1.0, n, n * (c + n / 2)] for n, c, _ in prefill], [s for *_, s in prefill])
    df = _nonneg_lstsq([[1.0, b, sc] for b, sc, _ in decode], [s for *_, s in decode])
    return {
        "prefill": {"a": pf[0], "b": pf[1], "c": pf[2]},
        "decode": {"d0": df[0], "d1": df[1], "d2": df[2]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvbridge_bench.plan.measure", description=__doc__)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cpu", type=int, default=0, help="pin to this CPU (-1: no pinning)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = measure(args.repeats, None if args.cpu < 0 else args.cpu)
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print("prefill/extend s = a + b*n + c*n*(ctx+n/2):", out["prefill"])
        print("decode step s = d0 + d1*batch + d2*sum(ctx):", out["decode"])
        for n, c, s in out["raw_prefill"]:
            print(f"  prefill n={n:4d} ctx={c:4d}: {s * 1e3:8.2f} ms")
        for b, c, s in out["raw_decode"]:
            print(f"  decode batch={b} sum ctx={c:5d}: {s * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
