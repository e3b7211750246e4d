"""The checksum in the copy, each side of a KV transfer apart: the CPU time
per GB of the work the TCP transport does per raw chunk of a ``KVSource`` /
``KVSink``, one pass against two, on the anchors' pages workload (4096
random 64 KiB pages into a shuffled destination, 4 MiB chunks), in
interleaved rounds, one thread (the transport's worker).

* sender, one pass: ``source.read_checksummed(off, n)`` (the pack core packs
  the chunk and computes its XXH3-64 in the same pass);
* sender, two passes: ``source.read(off, n)`` then ``chunk.checksum`` of it
  (what the transport does for a source without ``read_checksummed``);
* receiver, one pass: ``sink.write_checksummed(off, data, ck)`` (unpack and
  check in the same pass);
* receiver, two passes: ``chunk.checksum(data)`` then ``sink.write(off, data)``;
* and the pack core alone into one preallocated buffer (no page faults):
  pack with the checksum against pack then hash, and pack alone.

The two-pass receiver here hashes a whole 4 MiB chunk that is not in cache;
the transport hashes each 256 KiB piece right after it arrived, in L2, so
this overstates what the receiver saves in a transfer (the sender's saving
is the same in both).  Goodput of whole transfers, one pass against two:
``kvbridge-bench transfer --libs kvbridge,kvbridge-2pass,...``.

    python bench/bench_kv_checksum.py [--rounds 9] [--pages 4096] [--page-kib 64]

Under pytest a short run checks that both ways give the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from typing import Any

import numpy as np

CHUNK = 4 << 20


def _ends(pages: int, page_kib: int) -> tuple[Any, Any, Any, Any]:
    from kvbridge_bench.cli.compare import scenarios
    from kvbridge_bench.cli.compare_peers import scenario_buffer
    from kvbridge_bench.cli.transfer_peers import kv_ends as ends

    (scen,) = scenarios(
        types.SimpleNamespace(
            scenarios="pages", bulk_mib=0, pages=pages, page_kib=page_kib, llama_tokens=0,
            block_tables="shuffled",
        )
    )  # fmt: skip
    src_buf, dst_buf = scenario_buffer(scen, fill=True), scenario_buffer(scen, fill=False)
    source = ends(scen, src_buf, scen.src_bt, False)
    sink = ends(scen, dst_buf, scen.dst_bt, True)
    return scen, source, sink, (src_buf, dst_buf)


def measure(rounds: int = 9, pages: int = 4096, page_kib: int = 64) -> dict[str, Any]:
    """CPU seconds per GB of each way (median of the rounds) and one / two
    passes per side (median and range of the rounds' ratios)."""
    from kvbridge.wire.chunk import checksum

    scen, source, sink, _keep = _ends(pages, page_kib)
    total = source.nbytes
    grid = [(o, min(CHUNK, total - o)) for o in range(0, total, CHUNK)]
    chunks = [source.read_checksummed(o, n) for o, n in grid]

    def tx_one() -> None:
        for o, n in grid:
            source.read_checksummed(o, n)

    def tx_two() -> None:
        for o, n in grid:
            checksum(source.read(o, n))

    def rx_one() -> None:
        for (o, _), (data, ck) in zip(grid, chunks, strict=True):
            sink.write_checksummed(o, data, ck)

    def rx_two() -> None:
        for (o, _), (data, ck) in zip(grid, chunks, strict=True):
            if checksum(data) != ck:
                raise AssertionError("checksum mismatch")
            sink.write(o, data)

    rng, out = source.range, np.empty(CHUNK, dtype=np.uint8)

    def fused() -> None:  # the pack core alone, into one buffer (no allocation)
        for o, n in grid:
            rng.pack(out[:n], offset=o, nbytes=n, checksum=True)

    def then_hash() -> None:
        for o, n in grid:
            rng.pack(out[:n], offset=o, nbytes=n, num_threads=1)
            checksum(out[:n].data)

    def pack_only() -> None:
        for o, n in grid:
            rng.pack(out[:n], offset=o, nbytes=n, num_threads=1)

    ways = {"sender 1 pass": tx_one, "sender 2 passes": tx_two,
            "receiver 1 pass": rx_one, "receiver 2 passes": rx_two,
            "core 1 pass": fused, "core 2 passes": then_hash, "core pack": pack_only}  # fmt: skip
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds + 1):  # the first round warms up
        for name, fn in ways.items():
            t = time.thread_time()
            fn()
            if r:
                cpu[name].append((time.thread_time() - t) / total * 1e9)
    out: dict[str, Any] = {"bytes": total, "chunks": len(grid), "rounds": rounds, "rows": []}
    for side in ("sender", "receiver"):  # the transport's calls
        one, two = cpu[f"{side} 1 pass"], cpu[f"{side} 2 passes"]
        ratios = [b / a for a, b in zip(one, two, strict=True)]
        out["rows"].append(
            {
                "side": side,
                "one_s_per_GB": statistics.median(one),
                "two_s_per_GB": statistics.median(two),
                "two_over_one": (statistics.median(ratios), min(ratios), max(ratios)),
            }
        )
    gbps = {k: statistics.median(1 / v for v in cpu[k]) for k in cpu}  # s/GB -> GB/s
    ratios = [b / a for a, b in zip(cpu["core 1 pass"], cpu["core 2 passes"], strict=True)]
    out["core"] = {
        "one_GBps": gbps["core 1 pass"],
        "two_GBps": gbps["core 2 passes"],
        "pack_GBps": gbps["core pack"],
        "one_over_two_speed": (statistics.median(ratios), min(ratios), max(ratios)),
    }
    want = np.concatenate([np.frombuffer(d, np.uint8) for d, _ in chunks])
    got = np.concatenate([np.frombuffer(sink_read(scen, sink, o, n), np.uint8) for o, n in grid])
    out["same_bytes"] = bool(np.array_equal(want, got))
    return out


def sink_read(scen: Any, sink: Any, off: int, n: int) -> Any:
    """The sink's pages packed back (to compare with what was sent)."""
    out = np.empty(n, dtype=np.uint8)
    sink.range.pack(out, offset=off, nbytes=n)
    return out


def format_rows(res: dict[str, Any]) -> str:
    lines = [
        f"# {res['bytes'] >> 20} MiB of KV pages in {res['chunks']} chunks of 4 MiB, "
        f"{res['rounds']} interleaved rounds, one thread; CPU seconds per GB (thread time); "
        f"bytes equal: {res['same_bytes']}"
    ]
    for r in res["rows"]:
        med, lo, hi = r["two_over_one"]
        lines.append(
            f"{r['side']:<9} one pass {r['one_s_per_GB']:.3f} s/GB  two passes "
            f"{r['two_s_per_GB']:.3f} s/GB  two / one {med:.2f}x ({lo:.2f}-{hi:.2f})"
        )
    c = res["core"]
    med, lo, hi = c["one_over_two_speed"]
    lines.append(
        f"pack core, one buffer, no allocation: one pass {c['one_GBps']:.1f} GB/s, pack then "
        f"xxhash {c['two_GBps']:.1f} GB/s, pack alone {c['pack_GBps']:.1f} GB/s; one pass / "
        f"two: {med:.2f}x ({lo:.2f}-{hi:.2f})"
    )
    return "\n".join(lines)


def test_one_pass_and_two_passes_give_the_same_bytes() -> None:
    res = measure(rounds=1, pages=256, page_kib=64)
    assert res["same_bytes"]
    assert all(r["one_s_per_GB"] > 0 and r["two_s_per_GB"] > 0 for r in res["rows"])
    print("\n" + format_rows(res))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--pages", type=int, default=4096)
    p.add_argument("--page-kib", type=int, default=64)
    a = p.parse_args()
    print(f"# python bench/bench_kv_checksum.py {' '.join(sys.argv[1:])}")
    print(format_rows(measure(a.rounds, a.pages, a.page_kib)))
