"""Where a bulk TCP transfer's time goes: goodput and CPU per GB of each side
(user and system time, the event-loop thread apart from the worker
threads) for kvbridge and for raw uvloop sockets moving the same bytes over
the same connections between the same two processes, interleaved round by
round, and for variants with the checksum work stubbed out (an experiment:
not a mode the library has; the receiver then accepts every chunk):

* ``kvbridge``: as shipped;
* ``no-tx-hash``: the sender's checksum pass stubbed out;
* ``no-rx-hash``: the receiver's hashing of the arriving pieces stubbed out;
* ``no-hash``: both;
* ``raw``: a u64 length and the bytes per connection, read straight into one buffer.

With ``--scenario pages`` the transfers are the anchors' 4096 random pages of
64 KiB (``kvbridge-bench transfer``'s pages scenario: a contiguous source
block table, a shuffled destination) through ``KVSource`` / ``KVSink``, and
the variants are

* ``kvbridge``: as shipped (the sender writes the cache's pages themselves
  and hashes them; the receiver checks and scatters each chunk in one pass);
* ``packed``: the sender packs each chunk with its checksum in the pack's
  copy instead (``KVSource(..., zero_copy=False)``);
* ``rx-2pass``: the receiver hashes each chunk as it arrives (256 KiB
  pieces, in cache) and then unpacks it without a check (its sink without
  ``write_checksummed``).

    python bench/bench_tcp_cpu.py [--mib 256] [--streams 4] [--rounds 8] [--variants ...]
    python bench/bench_tcp_cpu.py --scenario pages [--rounds 8]

Under pytest a short run checks that every variant moves its bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import time
import types
from typing import Any

VARIANTS = ("kvbridge", "no-tx-hash", "no-rx-hash", "no-hash")
PAGE_VARIANTS = ("kvbridge", "packed", "rx-2pass")
MODE = 0x90  # a CONTROL frame that sets the receiver's variant


def _rx_variant(name: str) -> None:
    """Stub the receiver's checksum work out (or back in), in this process."""
    import xxhash

    from kvbridge.wire import codec, rxtransfer

    class NoHash:
        def update(self, b: Any) -> None:
            pass

        def intdigest(self) -> int:
            return -1

    rx: Any = rxtransfer.RxTransfer
    if not hasattr(rx, "_shipped_on_placed"):
        rx._shipped_on_placed = rx._on_placed
    shipped = rx._shipped_on_placed
    codec.xxhash = types.SimpleNamespace(  # type: ignore[attr-defined]
        xxh3_64=NoHash if name in ("no-rx-hash", "no-hash") else xxhash.xxh3_64,
        xxh3_64_intdigest=xxhash.xxh3_64_intdigest,
    )

    def on_placed(self: Any, conn: Any, m: Any, now: float) -> Any:
        if name != "kvbridge":
            m = dataclasses.replace(m, digest=m.checksum)
        return shipped(self, conn, m, now)

    rx._on_placed = on_placed


def _tx_variant(name: str) -> None:
    from kvbridge.wire import chunk

    mod: Any = chunk
    if not hasattr(mod, "_shipped_checksum"):
        mod._shipped_checksum = mod.checksum
    mod.checksum = (lambda d: 0) if name in ("no-tx-hash", "no-hash") else mod._shipped_checksum


def _cpu(pid: int) -> dict[str, tuple[float, float]]:
    """(user, system) seconds of the process's main thread ("loop") and of
    its other threads together ("workers")."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"loop": (0.0, 0.0), "workers": (0.0, 0.0)}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                stat = fh.read()
        except FileNotFoundError:
            continue
        f = stat[stat.rindex(")") + 2 :].split()
        key = "loop" if int(tid) == pid else "workers"
        u, s = out[key]
        out[key] = (u + int(f[11]) / tick, s + int(f[12]) / tick)
    return out


def _pages() -> Any:
    """The anchors' pages scenario of ``kvbridge-bench transfer``."""
    from kvbridge_bench.cli.compare import scenarios

    args = types.SimpleNamespace(
        scenarios="pages", page_kib=64, pages=4096, block_tables="shuffled", bulk_mib=256
    )
    (scen,) = scenarios(args)
    return scen


def _server(q: Any, scenario: str = "bulk") -> None:
    from kvbridge.transport.tcp import run
    from kvbridge.transport.tcp.receiver import TcpReceiver
    from kvbridge_bench.cli import transfer_bench as bm

    async def main() -> None:
        rx = await TcpReceiver("127.0.0.1", 0).start()
        srv = bm.BenchServer(rx)
        if scenario == "pages":
            from kvbridge_bench.cli.compare_peers import scenario_buffer
            from kvbridge_bench.cli.transfer_peers import kv_ends

            scen = _pages()
            dst = scenario_buffer(scen, fill=False)

            def on_expect(conn: Any, typ: int, payload: bytes) -> None:
                rid = payload[8:].decode()
                sink = kv_ends(scen, dst, scen.dst_bt, True)
                if rid.endswith("-rx-2pass"):
                    del sink.write_checksummed
                h = rx.expect(rid, sink, timeout=600)
                conn.send_control(bm.EXPECT_TOKEN, h.token + payload[8:])

            rx.on_control(bm.EXPECT_REQ, on_expect)

        def on_mode(conn: Any, typ: int, payload: bytes) -> None:
            _rx_variant(payload.decode())
            conn.send_control(MODE + 1, payload)

        rx.on_control(MODE, on_mode)
        loop = asyncio.get_running_loop()
        raw = await loop.create_server(lambda: bm._RawRx(srv), "127.0.0.1", 0)
        q.put((rx.port, raw.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    run(main())


def measure(
    mib: int = 256,
    streams: int = 4,
    rounds: int = 8,
    variants: tuple[str, ...] = VARIANTS,
    scenario: str = "bulk",
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """Every variant and raw, round by round; per row the goodput (median),
    the ratio to raw (median and range of the rounds) and the CPU seconds
    per GB of each side's loop thread and workers (user, system)."""
    from kvbridge.transport.tcp import run
    from kvbridge.transport.tcp.kvio import BytesSource
    from kvbridge.transport.tcp.sender import TcpSender
    from kvbridge_bench.cli import transfer_bench as bm

    nbytes = mib << 20
    pages = scenario == "pages"
    if pages:
        from kvbridge_bench.cli.compare_peers import scenario_buffer
        from kvbridge_bench.cli.transfer_peers import kv_ends

        scen = _pages()
        nbytes = scen.nbytes
        src_buf = scenario_buffer(scen, fill=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_server, args=(q, scenario), daemon=True)
    proc.start()
    port, raw_port = q.get(timeout=60)
    names = [*variants, "raw"]

    async def main() -> dict[str, Any]:
        data = memoryview(src_buf.data) if pages else memoryview(os.urandom(nbytes))
        tx = TcpSender("127.0.0.1", port, streams=streams, compression="off", chunk_size=chunk_size)
        await tx.connect()
        broker = bm._TokenBroker(tx)
        acks: asyncio.Queue[bytes] = asyncio.Queue()
        tx.on_control(MODE + 1, lambda c, t, p: acks.put_nowait(p))
        conns: list[Any] = []
        gbps: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        me = os.getpid()
        for r in range(rounds + 1):  # the first round warms up
            for name in names:
                if name != "raw":
                    if not pages:
                        _tx_variant(name)
                        tx.send_control(MODE, name.encode())
                        await asyncio.wait_for(acks.get(), 30)
                    tok = await broker.token(f"r{r}-{name}", nbytes)
                c0 = (_cpu(me), _cpu(proc.pid))
                t0 = time.perf_counter()
                if name == "raw":
                    await bm._raw_run("127.0.0.1", raw_port, data, streams, conns)
                else:
                    src = (
                        kv_ends(scen, src_buf, scen.src_bt, False, zero_copy=name != "packed")
                        if pages
                        else BytesSource(data)
                    )
                    await tx.send(f"r{r}-{name}", src, token=tok, timeout=600).wait(600)
                dt = time.perf_counter() - t0
                c1 = (_cpu(me), _cpu(proc.pid))
                if r:
                    gbps[name].append(nbytes / dt / 1e9)
                    per = {}
                    for side, a, b in (("sender", c0[0], c1[0]), ("receiver", c0[1], c1[1])):
                        for th in ("loop", "workers"):
                            per[f"{side} {th}"] = tuple(
                                (b[th][k] - a[th][k]) / nbytes * 1e9 for k in (0, 1)
                            )
                    cpu[name].append(per)
        _tx_variant("kvbridge")
        for _, w in conns:
            w.close()
        await tx.close()
        out: dict[str, Any] = {
            "bytes": nbytes,
            "streams": streams,
            "rounds": rounds,
            "scenario": scenario,
            "rows": [],
        }
        for name in names:
            ratios = [a / b for a, b in zip(gbps[name], gbps["raw"], strict=True)]
            keys = cpu[name][0].keys()
            mean = {
                k: tuple(sum(c[k][j] for c in cpu[name]) / rounds for j in (0, 1)) for k in keys
            }
            out["rows"].append(
                {
                    "row": name,
                    "gbps": statistics.median(gbps[name]),
                    "vs_raw": (statistics.median(ratios), min(ratios), max(ratios)),
                    "cpu_s_per_GB": mean,
                }
            )
        return out

    try:
        return run(main())
    finally:
        proc.kill()
        proc.join()


def format_rows(res: dict[str, Any]) -> str:
    what = "4096 random 64 KiB pages, " if res.get("scenario") == "pages" else ""
    lines = [
        f"# {what}{res['bytes'] >> 20} MiB transfers over {res['streams']} streams, "
        f"{res['rounds']} interleaved rounds; CPU: seconds per GB moved, user + system"
    ]
    for r in res["rows"]:
        med, lo, hi = r["vs_raw"]
        cpu = r["cpu_s_per_GB"]
        total = sum(u + s for u, s in cpu.values())
        parts = ", ".join(f"{k} {u:.3f}+{s:.3f}" for k, (u, s) in cpu.items() if u + s > 0.0005)
        lines.append(
            f"{r['row']:<11} {r['gbps']:5.2f} GB/s  vs raw {med:.2f}x ({lo:.2f}-{hi:.2f})  "
            f"CPU {total:.3f} s/GB: {parts}"
        )
    return "\n".join(lines)


def test_every_variant_moves_its_bytes() -> None:
    res = measure(mib=16, streams=2, rounds=1)
    assert [r["row"] for r in res["rows"]] == [*VARIANTS, "raw"]
    assert all(r["gbps"] > 0 for r in res["rows"])
    print("\n" + format_rows(res))


def test_the_pages_variants_move_their_bytes() -> None:
    res = measure(streams=2, rounds=1, variants=PAGE_VARIANTS, scenario="pages")
    assert [r["row"] for r in res["rows"]] == [*PAGE_VARIANTS, "raw"]
    assert all(r["gbps"] > 0 for r in res["rows"])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--variants", default=None, help="default: every variant of the scenario")
    p.add_argument("--scenario", choices=("bulk", "pages"), default="bulk")
    p.add_argument("--chunk-kib", type=int, default=None, help="default: fitted (4 MiB here)")
    a = p.parse_args()
    names = a.variants or ",".join(PAGE_VARIANTS if a.scenario == "pages" else VARIANTS)
    print(f"# python bench/bench_tcp_cpu.py {' '.join(sys.argv[1:])}")
    chunk = None if a.chunk_kib is None else a.chunk_kib << 10
    variants = tuple(names.split(","))
    print(format_rows(measure(a.mib, a.streams, a.rounds, variants, a.scenario, chunk)))
