"""The pack core of two source trees in one process, calls interleaved.

    git worktree add --detach /tmp/kvb-base-pack main
    python bench/pack_core_vs_commit.py --base /tmp/kvb-base-pack --new .

Builds each tree's C++ CPU core (``csrc/*.cpp`` but UCX and CUDA, with the
Release flags ``-O3 -DNDEBUG``) as its own shared library, loads both with
ctypes and calls their ABI 1 entry points ``kvb_pack_cpu`` / ``kvb_unpack_cpu``
on the same cache and wire buffers, alternating call by call (the order flips
every round), so that both see the same machine load.  Prints new / base
throughput for each case of ``kvbridge-bench pack`` that both trees have
(medians over the rounds; above 1: the new tree is faster).  Python is not on
the timed path beyond the ctypes call.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


class Desc(ctypes.Structure):  # kvb_cache_desc, ABI 1 (both trees accept it)
    _fields_ = [
        ("abi_version", ctypes.c_int32),
        ("num_layers", ctypes.c_int32),
        ("num_components", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("head_bytes", ctypes.c_int64),
        ("page_tokens", ctypes.c_int64),
        ("num_pages", ctypes.c_int64),
        ("stride_component", ctypes.c_int64),
        ("stride_page", ctypes.c_int64),
        ("stride_token", ctypes.c_int64),
        ("stride_head", ctypes.c_int64),
        ("layer_base", ctypes.POINTER(ctypes.c_void_p)),
        ("device", ctypes.c_int32),
    ]


class Range(ctypes.Structure):  # kvb_range, ABI 1
    _fields_ = [
        ("token_start", ctypes.c_int64),
        ("token_end", ctypes.c_int64),
        ("layer_start", ctypes.c_int32),
        ("layer_end", ctypes.c_int32),
        ("block_table", ctypes.POINTER(ctypes.c_int32)),
        ("block_table_len", ctypes.c_int64),
    ]


class Exec(ctypes.Structure):
    _fields_ = [("num_threads", ctypes.c_int32), ("cuda_stream", ctypes.c_uint64)]


# name -> (layers, heads, head_dim, itemsize, page_tokens, components)
CASES = {
    "Llama-3-8B fp16": (32, 8, 128, 2, 16, 2),
    "Llama-3-8B bf16": (32, 8, 128, 2, 16, 2),
    "DeepSeek-V3 MLA bf16": (61, 1, 576, 2, 64, 1),
    "synthetic 2 KiB pages": (4, 8, 128, 2, 1, 2),
    "synthetic 4 KiB pages": (4, 8, 128, 2, 2, 2),
    "synthetic 16 KiB pages": (4, 8, 128, 2, 8, 2),
    "synthetic 64 KiB pages": (4, 8, 128, 2, 32, 2),
    "synthetic 256 KiB pages": (4, 8, 128, 2, 128, 2),
}


def build(tree: Path, out: Path) -> ctypes.CDLL:
    srcs = sorted((tree / "csrc").glob("*.cpp"))  # the CPU core (pack_cuda_absent.cpp for CUDA)
    cmd = ["c++", "-O3", "-DNDEBUG", "-fPIC", "-shared", "-std=c++17", "-pthread"]
    cmd += [
        "-I",
        str(tree / "csrc/include"),
        "-I",
        str(tree / "csrc"),
        *map(str, srcs),
        "-o",
        str(out),
    ]
    subprocess.run(cmd, check=True, timeout=600)
    lib = ctypes.CDLL(str(out), mode=ctypes.RTLD_LOCAL)
    for fn in (lib.kvb_pack_cpu, lib.kvb_unpack_cpu):
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.POINTER(Desc),
            ctypes.POINTER(Range),
            ctypes.c_uint64,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.POINTER(Exec),
        ]
    lib.kvb_last_error.restype = ctypes.c_char_p
    return lib


def setup(case: str, mib: float) -> dict[str, Any]:
    layers, heads, dim, isz, pt, comps = CASES[case]
    hb = dim * isz
    page_inner = pt * heads * hb
    per_page = layers * comps * page_inner
    pages = max(1, int(mib * (1 << 20)) // per_page)
    pool = 2 * pages
    rng = np.random.default_rng(0)
    layer_bytes = comps * pool * page_inner
    mem = [rng.integers(0, 256, layer_bytes, dtype=np.uint8) for _ in range(layers)]
    bases = (ctypes.c_void_p * layers)(*[m.ctypes.data for m in mem])
    d = Desc(1, layers, comps, heads, hb, pt, pool, pool * page_inner, page_inner, heads * hb, hb,
             bases, -1)  # fmt: skip
    bt = rng.permutation(pool)[:pages].astype(np.int32)
    tokens = pages * pt
    r = Range(0, tokens, 0, layers, bt.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), pages)
    wire = np.empty(layers * comps * tokens * heads * hb, np.uint8)
    return {"desc": d, "range": r, "wire": wire, "keep": (mem, bases, bt)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--new", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--mib", type=float, default=32.0)
    ap.add_argument("--threads", type=int, default=0, help="kvb_exec.num_threads (0: automatic)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    libs = {
        "base": build(args.base, args.build_dir / "libkvb_base_cmp.so"),
        "new": build(args.new, args.build_dir / "libkvb_new_cmp.so"),
    }
    ex = Exec(args.threads, 0)
    print(
        f"{'case':<26}{'pack new/base':>15}{'(min-max)':>14}{'unpack new/base':>17}{'(min-max)':>14}"
    )
    for case in CASES:
        s = setup(case, args.mib)
        wire, n = s["wire"], s["wire"].nbytes
        ptr = wire.ctypes.data
        ref = None
        for name, lib in libs.items():  # both must produce the same bytes
            rc = lib.kvb_pack_cpu(ctypes.byref(s["desc"]), ctypes.byref(s["range"]), 0, ptr, n,
                                  ctypes.byref(ex))  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"{name}: {lib.kvb_last_error().decode()}")
            if ref is None:
                ref = wire.copy()
            elif not np.array_equal(wire, ref):
                raise RuntimeError(f"{case}: the two trees pack different bytes")
        ratios: dict[str, list[float]] = {"pack": [], "unpack": []}
        for r in range(args.rounds):
            t: dict[tuple[str, str], float] = {}
            order = list(libs.items()) if r % 2 == 0 else list(libs.items())[::-1]
            for op in ("pack", "unpack"):
                for name, lib in order:
                    fn = lib.kvb_pack_cpu if op == "pack" else lib.kvb_unpack_cpu
                    t0 = time.perf_counter()
                    rc = fn(ctypes.byref(s["desc"]), ctypes.byref(s["range"]), 0, ptr, n,
                            ctypes.byref(ex))  # fmt: skip
                    t[(name, op)] = time.perf_counter() - t0
                    if rc != 0:
                        raise RuntimeError(lib.kvb_last_error().decode())
            for op in ratios:
                ratios[op].append(t[("base", op)] / t[("new", op)])
        line = f"{case:<26}"
        for op, width in (("pack", 15), ("unpack", 17)):
            v = ratios[op]
            line += f"{statistics.median(v):>{width}.3f}{f'({min(v):.2f}-{max(v):.2f})':>14}"
        print(line, flush=True)
    print(f"{args.rounds} rounds of one call each, alternating which tree goes first; "
          f"{args.mib:g} MiB of wire per case")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
