"""Move the same KV pages with kvbridge's UCX path, NIXL (UCX backend, DRAM
descriptors), Mooncake's transfer engine (TCP) and a raw ucxx send of one
contiguous buffer, in one run, under the same UCX transport settings.

Scenarios: ``pages`` (4096 pages of 64 KiB, 256 MiB) and ``llama`` (a
Llama-3-8B request of --llama-tokens tokens in 16-token pages, bf16; 32768
tokens = 4 GiB).  Each library runs as a receiver and a sender process; one
warm-up, then the median of --iters transfers, timed at the sender from post
until it knows the bytes landed.  Integrity is checked with a hash of the
moved pages at both ends.  Libraries that are not installed are reported and
skipped.  Numbers swing between runs on a shared machine: compare within one.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np

from ..errors import KVBridgeTimeout, PeerGone
from ..layout import DType, KVLayout
from .compare_peers import Scenario, receiver_main, sender_main

LIBS = ("kvbridge", "nixl", "mooncake", "ucxx")
_MODULES = {
    "kvbridge": "kvbridge._ucx",
    "nixl": "nixl",
    "mooncake": "mooncake.engine",
    "ucxx": "ucxx",
}
_INSTALL = {
    "kvbridge": "build kvbridge with UCX (pip install libucx-cu12 before building)",
    "nixl": "pip install torch==2.13.0 nixl",
    "mooncake": "pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1",
    "ucxx": "pip install ucxx-cu12",
}
# name -> UCX_TLS.  Each library keeps its own default UCX error handling,
# except NIXL over shared memory, which needs ucx_error_handling_mode=none.
SETTINGS = {"tcp": "tcp", "shm": "tcp,sm"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--libs", default=",".join(LIBS), help=f"comma list of {','.join(LIBS)}")
    p.add_argument(
        "--settings",
        default="tcp,shm",
        help="comma list of: tcp (UCX_TLS=tcp), shm (UCX_TLS=tcp,sm)",
    )
    p.add_argument("--scenarios", default="pages,llama", help="comma list of: pages, llama")
    p.add_argument("--pages", type=int, default=4096, help="pages of the 'pages' scenario")
    p.add_argument("--page-kib", type=int, default=64, help="page size of the 'pages' scenario")
    p.add_argument(
        "--llama-tokens",
        type=int,
        default=32768,
        help="request length of the 'llama' scenario (scale down on small machines)",
    )
    p.add_argument(
        "--block-tables",
        choices=["shuffled", "contiguous"],
        default="shuffled",
        help="destination pages: a random permutation (fragmented cache) or in order",
    )
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--kvb-error-mode",
        choices=["none", "peer"],
        default="none",
        help="kvbridge's UCX endpoint error handling (its default: none, with heartbeats)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per library and scenario")


def missing_libraries(libs: list[str]) -> dict[str, str]:
    out = {}
    for lib in libs:
        try:
            found = importlib.util.find_spec(_MODULES[lib]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out[lib] = _INSTALL[lib]
    return out


def scenarios(args: Any) -> list[Scenario]:
    rng = np.random.default_rng(0)
    out = []
    names = args.scenarios.split(",")
    if "pages" in names:
        # one layer, one 'latent head' of page_kib KiB per 16-token page
        lay = KVLayout(
            num_layers=1,
            num_kv_heads=1,
            head_dim=args.page_kib * 1024 // 32,
            dtype=DType.FP16,
            page_tokens=16,
            mla=True,
            stacked=True,
            name="pages",
        )
        n = args.pages
        dst = rng.permutation(n) if args.block_tables == "shuffled" else np.arange(n)
        out.append(
            Scenario(f"{n} pages x {args.page_kib} KiB", lay, n, np.arange(n), dst, 0, n * 16)
        )
    if "llama" in names:
        lay = KVLayout.for_model("llama-3-8b", page_tokens=16, stacked=True)
        n = lay.pages_for(args.llama_tokens)
        dst = rng.permutation(n) if args.block_tables == "shuffled" else np.arange(n)
        out.append(
            Scenario(
                f"llama-3-8b {args.llama_tokens} tokens",
                lay,
                n,
                np.arange(n),
                dst,
                0,
                args.llama_tokens,
            )
        )
    return out


def run_one(
    lib: str, scen: Scenario, setting: str, iters: int, timeout: float, error_mode: str = "none"
) -> dict[str, Any]:
    env = {
        "UCX_TLS": SETTINGS[setting],
        "KVB_BENCH_SETTING": setting,
        "KVB_BENCH_ERROR_MODE": error_mode,
    }
    ctx = mp.get_context("spawn")
    rconn, rchild = ctx.Pipe()
    sconn, schild = ctx.Pipe()
    recv = ctx.Process(
        target=receiver_main,
        args=(rchild, env, lib, scen, iters),
        daemon=True,
        name=f"{lib} receiver",
    )
    recv.start()
    send = None
    try:
        msg = _get(rconn, timeout, recv)
        if msg[0] != "ready":
            return {"error": msg[1]}
        send = ctx.Process(
            target=sender_main,
            args=(schild, env, lib, scen, iters, msg[1]),
            daemon=True,
            name=f"{lib} sender",
        )
        send.start()
        res = _get(sconn, timeout, send)
        if res[0] != "times":
            return {"error": res[1]}
        rconn.send(("digest",))
        dig = _get(rconn, timeout, recv)
        if dig[0] != "digest":
            return {"error": dig[1]}
        times = res[1][1:]  # drop the warm-up
        med = statistics.median(times)
        return {"seconds": med, "gbps": scen.nbytes / med / 1e9, "ok": dig[1] == res[2]}
    except (KVBridgeTimeout, PeerGone) as e:
        return {"error": str(e)}
    finally:
        for p in (send, recv):
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        for c in (rconn, sconn, rchild, schild):
            c.close()


def _get(conn: Any, timeout: float, proc: Any) -> Any:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0.2):
            raise PeerGone(f"{proc.name} exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise KVBridgeTimeout(f"no answer within {timeout} s")
    return conn.recv()


def run(args: Any) -> int:
    libs = [x for x in args.libs.split(",") if x]
    unknown = set(libs) - set(LIBS)
    if unknown:
        print(f"unknown libraries: {sorted(unknown)}", file=sys.stderr)
        return 2
    missing = missing_libraries(libs)
    for lib, how in missing.items():
        print(f"missing: {lib} (not installed: {how}); skipped")
    present = [x for x in libs if x not in missing]
    results = compare(
        present,
        scenarios(args),
        args.settings.split(","),
        args.iters,
        args.timeout,
        args.kvb_error_mode,
    )
    print(format_table(results))
    return 0 if all(r.get("ok", False) for r in results) else 1


def compare(
    libs: list[str],
    scens: list[Scenario],
    settings: list[str],
    iters: int,
    timeout: float,
    error_mode: str = "none",
    verbose: bool = True,
) -> list[dict[str, Any]]:
    rows = []
    for scen in scens:
        for setting in settings:
            base = None
            block = []
            for lib in libs:
                r = run_one(lib, scen, setting, iters, timeout, error_mode)
                r.update(lib=lib, scenario=scen.name, setting=setting, nbytes=scen.nbytes)
                if verbose:
                    print(f"  {scen.name} / {setting} / {lib}: {r}", flush=True)
                block.append(r)
                if lib == "ucxx" and "gbps" in r:
                    base = r["gbps"]
            for r in block:
                r["ratio"] = (r["gbps"] / base) if base and "gbps" in r else None
            rows += block
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'scenario':<28} {'setting':<8} {'library':<9} {'GB/s':>7} {'ms/request':>11} {'vs raw ucxx':>11}  check"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['scenario']:<28} {r['setting']:<8} {r['lib']:<9} error: {r['error']}")
            continue
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "-"
        lines.append(
            f"{r['scenario']:<28} {r['setting']:<8} {r['lib']:<9} {r['gbps']:7.2f} {r['seconds'] * 1e3:11.2f} "
            f"{ratio:>11}  {'ok' if r['ok'] else 'CORRUPT'}"
        )
    return "\n".join(lines)
