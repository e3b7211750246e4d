"""Move the same KV bytes with kvbridge's UCX path, NIXL (UCX backend, DRAM
descriptors), Mooncake's transfer engine (TCP), a raw ucxx send of one
contiguous buffer and ``ucx_perftest`` put bandwidth (the limit), in one run,
under UCX_TLS=tcp and UCX_TLS=tcp,sm.

Each library is set up as its own documentation recommends for the
transport and the machine (a 2-core machine: NIXL without its progress
thread, the same endpoint error mode and TCP segment sizes as kvbridge), and
also with its default settings; every row prints its settings.  Scenarios:
``bulk`` (256 MiB, one contiguous run), ``pages`` (4096 pages of 64 KiB into
a shuffled destination) and ``llama`` (a Llama-3-8B request in 16-token
pages).  Each row runs as a receiver and a sender process; rounds interleave
the rows (--rounds), each run drops its first transfer (warm-up) and the
medians over all runs are compared, as ratios against the tuned NIXL and
``ucx_perftest`` of the same run.  Two load points: idle, and with one core
kept busy by a spinning process (--loads), so that a result that flips is
visible.  Integrity is checked with a hash of the moved bytes at both ends.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError, KVBridgeTimeout, PeerGone
from kvbridge.layout import DType, KVLayout

from .compare_peers import Scenario, side_main

LIBS = ("kvbridge", "nixl", "mooncake", "ucxx", "perftest")
# importable modules of the other libraries (kvbridge's own: its UCX transport's check)
_MODULES = {
    "nixl": "nixl",
    "mooncake": "mooncake.engine",
    "ucxx": "ucxx",
    "perftest": "libucx",
}
_INSTALL = {
    "kvbridge": "build kvbridge with UCX (pip install libucx-cu12 before building)",
    "nixl": "pip install torch==2.13.0 nixl",
    "mooncake": "pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1",
    "ucxx": "pip install ucxx-cu12",
    "perftest": "pip install libucx-cu12 (ships ucx_perftest)",
}
SETTINGS = {"tcp": "tcp", "shm": "tcp,sm"}
# kvbridge's own UCX settings (loader.DEFAULT_UCX_CONFIG): the tuned rows of
# the other UCX libraries get the same segments and RMA rails (NIXL sets
# MAX_RMA_RAILS=2 itself).
SEG_ENV = {
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
    "UCX_MAX_RMA_RAILS": "2",
}
TUNED = "256k TCP segments, 2 RMA rails"


@dataclass
class Row:
    """One library set up one way."""

    name: str
    lib: str
    env: dict[str, str]
    opts: dict[str, Any]
    setting: str
    background: bool = False  # busy threads while idle: stopped between its bursts
    times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    corrupt: int = 0


def rows_for(
    libs: list[str], put_windows: tuple[int, ...] = (), poll_yields: tuple[int, ...] = ()
) -> list[Row]:
    """The rows of ``libs``; every value of ``put_windows`` adds a kvbridge
    row with that ``put_window`` (0: no limit), every value of
    ``poll_yields`` one with that ``poll_yield_us``."""
    out: list[Row] = []
    if "kvbridge" in libs:
        out.append(
            Row(
                "kvbridge",
                "kvbridge",
                {},
                {},
                f"defaults: error_mode=none, {TUNED}, progress=thread, "
                "busy_poll_us=1000, poll_yield_us=0, put_window=64",
            )
        )
        out.append(Row("kvbridge peer", "kvbridge", {}, {"error_mode": "peer"}, "error_mode=peer"))
        out.append(
            Row(
                "kvbridge 1 rail",
                "kvbridge",
                {"UCX_MAX_RMA_RAILS": "1"},
                {},
                "defaults but UCX_MAX_RMA_RAILS=1 (UCX's default)",
            )
        )
        for w in put_windows:
            out.append(
                Row(
                    f"kvbridge window={w}",
                    "kvbridge",
                    {},
                    {"put_window": w},
                    f"defaults but put_window={w}" + (" (no limit)" if w == 0 else ""),
                )
            )
        for y in poll_yields:
            out.append(
                Row(
                    f"kvbridge yield={y}",
                    "kvbridge",
                    {},
                    {"poll_yield_us": y},
                    f"defaults but poll_yield_us={y}",
                )
            )
    if "nixl" in libs:
        out.append(
            Row(
                "NIXL tuned",
                "nixl",
                dict(SEG_ENV),
                {"progress_thread": False, "params": {"ucx_error_handling_mode": "none"}},
                f"progress thread off, ucx_error_handling_mode=none, {TUNED}",
            )
        )
        out.append(
            Row(
                "NIXL defaults",
                "nixl",
                {},
                {"progress_thread": True, "params": {}},
                "defaults: progress thread on, ucx_error_handling_mode=peer",
                background=True,  # its progress threads spin (a core each) while idle
            )
        )
    if "mooncake" in libs:
        out.append(
            Row(
                "Mooncake TE",
                "mooncake",
                {"GLOG_minloglevel": "2"},  # its informational log lines only
                {},
                "TCP transport, defaults, batches of 1024 (its TCP limit)",
            )
        )
    if "ucxx" in libs:
        out.append(
            Row(
                "raw ucxx 256k seg",
                "ucxx",
                dict(SEG_ENV),
                {},
                f"tag send, {TUNED} (ucxx's endpoint error handling stays on)",
            )
        )
        out.append(
            Row("raw ucxx defaults", "ucxx", {}, {}, "defaults: tag send, error handling on")
        )
    if "perftest" in libs:
        out.append(
            Row(
                "ucx_perftest",
                "perftest",
                dict(SEG_ENV),
                {},
                f"ucp_put_bw, message = the scenario's run, {TUNED}",
            )
        )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--libs", default=",".join(LIBS), help=f"comma list of {','.join(LIBS)}")
    p.add_argument(
        "--settings",
        default="tcp,shm",
        help="comma list of: tcp (UCX_TLS=tcp), shm (UCX_TLS=tcp,sm)",
    )
    p.add_argument("--scenarios", default="bulk,pages", help="comma list of: bulk, pages, llama")
    p.add_argument("--bulk-mib", type=int, default=256, help="size of the 'bulk' scenario")
    p.add_argument("--pages", type=int, default=4096, help="pages of the 'pages' scenario")
    p.add_argument("--page-kib", type=int, default=64, help="page size of the 'pages' scenario")
    p.add_argument(
        "--llama-tokens",
        type=int,
        default=16384,
        help="request length of the 'llama' scenario (scale down on small machines)",
    )
    p.add_argument(
        "--block-tables",
        choices=["shuffled", "contiguous"],
        default="shuffled",
        help="destination pages of 'pages' and 'llama': a random permutation or in order",
    )
    p.add_argument("--iters", type=int, default=4, help="transfers per run (the first is warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of every row")
    p.add_argument("--loads", default="idle,busy", help="comma list of: idle, busy (one core)")
    p.add_argument("--timeout", type=float, default=600.0, help="per run")
    p.add_argument(
        "--put-windows",
        default="",
        help="comma list of put_window values: one more kvbridge row each (0: no limit)",
    )
    p.add_argument(
        "--poll-yield-us",
        default="",
        help="comma list of poll_yield_us values: one more kvbridge row each",
    )


def missing_libraries(libs: list[str]) -> dict[str, str]:
    out = {}
    for lib in libs:
        if lib == "kvbridge":
            from kvbridge.transport.ucx import available

            found = available()
        else:
            try:
                found = importlib.util.find_spec(_MODULES[lib]) is not None
            except (ImportError, ValueError):
                found = False
        if lib == "perftest" and found and perftest_binary() is None:
            found = False
        if lib == "mooncake" and found:
            from .compare_peers import mooncake_unusable

            found = mooncake_unusable() is None
        if not found:
            out[lib] = _INSTALL[lib]
    return out


def _page_layout(page_kib: int, name: str) -> KVLayout:
    # one layer, one 'latent head' of page_kib KiB per 16-token page
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=page_kib * 1024 // 32,
        dtype=DType.FP16,
        page_tokens=16,
        mla=True,
        stacked=True,
        name=name,
    )


def scenarios(args: Any) -> list[Scenario]:
    rng = np.random.default_rng(0)
    out = []
    names = args.scenarios.split(",")
    if "bulk" in names:
        n = args.bulk_mib * 16  # 64 KiB pages, contiguous at both ends
        lay = _page_layout(64, "bulk")
        out.append(
            Scenario(
                f"bulk {args.bulk_mib} MiB", lay, n, np.arange(n), np.arange(n), 0, n * 16, True
            )
        )
    if "pages" in names:
        lay = _page_layout(args.page_kib, "pages")
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


# ---- one row's processes: a pair that stays up and moves bursts -----------------------------
class Pair:
    """A row's receiver and sender processes, up for one (load, scenario,
    UCX_TLS); ``burst(n)`` moves ``n`` transfers and checks the landed bytes.
    A row with busy background threads (``Row.background``) is stopped
    (SIGSTOP) between its bursts, so that it takes no core from the others."""

    def __init__(self, row: Row, scen: Scenario, setting: str, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        env = {"UCX_TLS": SETTINGS[setting], **row.env}
        self.row = row
        self.timeout = timeout
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.tag = 0
        for role in (0, 1):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=side_main,
                args=(child, role, env, row.lib, scen, row.opts),
                daemon=True,
                name=f"{row.name} {'sender' if role == 0 else 'receiver'}",
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.paused = False

    def get(self, i: int, want: str) -> Any:
        msg = _get(self.conns[i], self.timeout, self.procs[i])
        if msg[0] != want:
            raise KVBridgeError(f"{self.procs[i].name}: {msg[1] if msg[0] == 'error' else msg}")
        return msg

    def start(self) -> None:
        info = self.get(1, "info")[1]
        self.get(0, "info")
        self.conns[0].send(("peer", info))
        self.get(1, "ready")
        self.get(0, "ready")
        self.conns[0].send(("digest",))
        self.source_digest = self.get(0, "digest")[1]

    def burst(self, n: int) -> tuple[list[float], bool]:
        """Times of ``n`` transfers, and whether the landed bytes match."""
        self.resume()
        self.tag += 1
        self.conns[1].send(("arm", n, f"b{self.tag}"))
        self.get(1, "armed")
        self.conns[0].send(("run", n, f"b{self.tag}"))
        times = self.get(0, "times")[1]
        self.conns[1].send(("check",))
        ok = self.get(1, "digest")[1] == self.source_digest
        if self.row.background:
            self.pause()
        return times, ok

    def pause(self) -> None:
        if not self.paused:
            for p in self.procs:
                os.kill(p.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            for p in self.procs:
                os.kill(p.pid, signal.SIGCONT)
            self.paused = False

    def close(self) -> None:
        with contextlib.suppress(OSError, ProcessLookupError):
            self.resume()
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(("quit",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()


def perftest_binary() -> Path | None:
    try:
        import libucx
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    exe = root / "bin" / "ucx_perftest"
    return exe if exe.exists() else None


_FINAL = re.compile(r"^Final:\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", re.M)


def run_perftest(scen: Scenario, env: dict[str, str], iters: int, timeout: float) -> dict[str, Any]:
    """``ucx_perftest -t ucp_put_bw`` with messages of the scenario's run size
    (the whole buffer for bulk, one page otherwise) moving the same bytes."""
    exe = perftest_binary()
    if exe is None:
        return {"error": "ucx_perftest not found"}
    lib = str(exe.parent.parent / "lib")
    full = {
        **os.environ,
        **env,
        "LD_LIBRARY_PATH": lib + ":" + os.environ.get("LD_LIBRARY_PATH", ""),
    }
    _, length = scen.pieces(scen.src_bt)
    size = int(length.max())
    count = max(1, scen.nbytes // size)
    port = 13000 + (os.getpid() % 2000)
    n = max(count * iters, 8)
    args = ["-t", "ucp_put_bw", "-s", str(size), "-n", str(n), "-w", str(max(1, n // 8))]
    args += ["-p", str(port)]
    server = subprocess.Popen(
        [str(exe), *args], env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        out = subprocess.run(
            [str(exe), "127.0.0.1", *args],
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout
    except subprocess.TimeoutExpired:
        return {"error": "ucx_perftest timed out"}
    finally:
        server.kill()
        server.wait()
    m = _FINAL.search(out)
    if not m:
        return {"error": f"ucx_perftest printed no result: {out[-300:]!r}"}
    mbps = float(m.group(6))  # overall bandwidth, MB/s (2**20 bytes)
    seconds = scen.nbytes / (mbps * (1 << 20))
    return {"times": [seconds], "ok": True}


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def spinning_core(on: bool) -> Iterator[None]:
    """While active (``on``), one process keeps one core busy: the second
    load point of the benchmarks."""
    if not on:
        yield
        return
    p = mp.get_context("spawn").Process(target=_spin, daemon=True, name="busy core")
    p.start()
    try:
        time.sleep(0.2)
        yield
    finally:
        p.kill()
        p.join()


def _get(conn: Any, timeout: float, proc: Any) -> Any:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0.2):
            raise PeerGone(f"{proc.name} exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise KVBridgeTimeout(f"no answer within {timeout} s")
    return conn.recv()


# ---- the comparison ------------------------------------------------------------------------
def compare(
    libs: list[str],
    scens: list[Scenario],
    settings: list[str],
    iters: int,
    timeout: float,
    rounds: int = 1,
    loads: tuple[str, ...] = ("idle",),
    verbose: bool = True,
    put_windows: tuple[int, ...] = (),
    poll_yields: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Every row of every (load, scenario, setting).  The rows' processes
    stay up together and take turns: ``rounds`` rounds of one burst of
    ``iters`` transfers per row (order reversed every other round), after
    one warm-up transfer each; ``ucx_perftest`` runs once per round."""
    out: list[dict[str, Any]] = []
    for load in loads:
        with spinning_core(load == "busy"):
            for scen in scens:
                for setting in settings:
                    rows = rows_for(libs, put_windows, poll_yields)
                    pairs = _start_pairs(rows, scen, setting, timeout)
                    try:
                        for r in range(rounds):
                            for row in rows if r % 2 == 0 else rows[::-1]:
                                before, nerr = len(row.times), len(row.errors)
                                _one_burst(row, pairs.get(row.name), scen, setting, iters, timeout)
                                if verbose:
                                    got = (
                                        row.errors[-1]
                                        if len(row.errors) > nerr
                                        else _ms(row.times[before:])
                                    )
                                    print(
                                        f"  {load} / {scen.name} / {setting} / {row.name}: {got}",
                                        flush=True,
                                    )
                    finally:
                        for pair in pairs.values():
                            pair.close()
                    out += _summarise(rows, scen, setting, load)
    return out


def _start_pairs(rows: list[Row], scen: Scenario, setting: str, timeout: float) -> dict[str, Pair]:
    pairs: dict[str, Pair] = {}
    for row in rows:
        if row.lib == "perftest":
            continue
        pair = Pair(row, scen, setting, timeout)
        try:
            pair.start()
            pair.burst(1)  # warm-up, dropped
            pairs[row.name] = pair
        except (KVBridgeError, OSError) as e:
            row.errors.append(str(e))
            pair.close()
    return pairs


def _one_burst(
    row: Row, pair: Pair | None, scen: Scenario, setting: str, iters: int, timeout: float
) -> None:
    if row.lib == "perftest":
        r = run_perftest(scen, {"UCX_TLS": SETTINGS[setting], **row.env}, iters, timeout)
        if "error" in r:
            row.errors.append(r["error"])
        else:
            row.times += r["times"]
        return
    if pair is None:
        return  # it failed to start (the error is recorded)
    try:
        times, ok = pair.burst(iters)
    except (KVBridgeError, OSError) as e:
        row.errors.append(str(e))
        return
    row.times += times
    row.corrupt += 0 if ok else 1


def _ms(times: list[float]) -> str:
    return " ".join(f"{t * 1e3:.1f}" for t in times) + " ms"


def _summarise(rows: list[Row], scen: Scenario, setting: str, load: str) -> list[dict[str, Any]]:
    res = []
    for row in rows:
        r: dict[str, Any] = {
            "row": row.name,
            "lib": row.lib,
            "setting": row.setting,
            "scenario": scen.name,
            "tls": SETTINGS[setting],
            "load": load,
            "nbytes": scen.nbytes,
        }
        if row.times:
            med = statistics.median(row.times)
            r.update(seconds=med, gbps=scen.nbytes / med / 1e9, ok=row.corrupt == 0)
            r["samples"] = len(row.times)
        else:
            r["error"] = row.errors[0] if row.errors else "no samples"
        res.append(r)
    by = {r["row"]: r for r in res}
    for r in res:
        for base, key in (("NIXL tuned", "vs_nixl"), ("ucx_perftest", "vs_perftest")):
            b = by.get(base)
            r[key] = r["gbps"] / b["gbps"] if b and "gbps" in b and "gbps" in r else None
    return res


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'load':<5} {'scenario':<20} {'UCX_TLS':<7} {'row':<18} {'GB/s':>6} {'ms':>8} "
        f"{'vs NIXL tuned':>13} {'vs perftest':>11} check  setting"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        pre = f"{r['load']:<5} {r['scenario']:<20} {r['tls']:<7} {r['row']:<18}"
        if "error" in r:
            lines.append(f"{pre} error: {r['error'][:120]}")
            continue
        vn = f"{r['vs_nixl']:.2f}x" if r.get("vs_nixl") else "-"
        vp = f"{r['vs_perftest']:.2f}x" if r.get("vs_perftest") else "-"
        check = "ok" if r["ok"] else "CORRUPT"
        if r["lib"] == "perftest":
            check = "-"
        lines.append(
            f"{pre} {r['gbps']:6.2f} {r['seconds'] * 1e3:8.1f} {vn:>13} {vp:>11} {check:<6} "
            f"{r['setting']}"
        )
    return "\n".join(lines)


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
    print(f"# kvbridge-bench compare {' '.join(sys.argv[2:])}")
    results = compare(
        present,
        scenarios(args),
        args.settings.split(","),
        args.iters,
        args.timeout,
        args.rounds,
        tuple(x for x in args.loads.split(",") if x),
        put_windows=tuple(int(x) for x in args.put_windows.split(",") if x),
        poll_yields=tuple(int(x) for x in args.poll_yield_us.split(",") if x),
    )
    print(format_table(results))
    return 0 if all(r.get("ok", False) for r in results) else 1
