"""One process, two SyncBridges over TCP (or UCX), one engine thread (this
one) stepping with a load for 90% of each 2 ms step while 189 MB transfers
run: kvbridge-bench embedded's ``inproc`` goodput, alone, to run under a
sampling profiler that sees the GIL, e.g.

  py-spy record --gil --threads -r 500 -f raw -o gil.txt -- \\
      python bench/embedded_gil.py --load python
  python bench/embedded_gil.py --summarize gil.txt

``--summarize`` reads py-spy's raw (collapsed) output and prints the share
of the GIL samples each thread held and, per kvbridge thread, the functions
(innermost kvbridge / asyncio / uvloop frame) that held it most.
"""

from __future__ import annotations

import argparse
import collections
import re
import threading
import time

from kvbridge_bench.cli import embedded_peers as ep


def run(load: str, via: str, repeats: int, tokens: int) -> None:
    pages = ep.SMOL.pages_for(tokens) + 8
    pre_b, md_b, _, _ = ep.make_pair(via, pages, pages)
    timer = ep.Timer()
    dec = ep.Decode(md_b, via, timer, pages)
    pre = ep.Prefill(pre_b, "d", via, timer)
    pending: list[tuple[str, bytes]] = []
    try:
        step = ep.Step(load, 2.0, 0.9)
        t0 = time.perf_counter()
        secs = ep.drive_goodput(
            pre,
            lambda rid, n, i: pending.append((rid, dec.expect(rid, n, i))),
            lambda: pending.pop(0) if pending else None,
            dec.poll,
            step,
            repeats,
            tokens,
        )
        wall = time.perf_counter() - t0
        # the receiver's frame-buffer pool (a private part, read for this count only)
        pool = (
            getattr(getattr(md_b._decode, "tcp", None), "_bufpool", None) if via == "tcp" else None
        )
        hits = getattr(pool, "hits", None)
        if hits is not None:
            print(f"receive buffers: {hits} of {hits + pool.misses} gets from the pool")
    finally:
        pre_b.close()
        md_b.close()
    nbytes = tokens * ep.SMOL.bytes_per_token
    print(f"{load} {via}: " + ", ".join(f"{nbytes / s / 1e6:.0f} MB/s" for s in secs)
          + f" ({wall:.1f} s; threads: {sorted(t.name for t in threading.enumerate())})")  # fmt: skip


_FRAME = re.compile(r"^(?P<fn>[^ ]+) \((?P<file>[^:]+)(?::\d+)?\)$")


def summarize(path: str, top: int) -> None:
    """Collapsed stacks ``thread (tid): name;frame;frame N`` (py-spy -f raw
    --threads): samples by thread, and by innermost library frame."""
    by_thread: collections.Counter[str] = collections.Counter()
    by_fn: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        if "_find_and_load" in stack:  # imports at start, not the transfers
            continue
        frames = stack.split(";")
        thread = frames[0]  # 'thread (tid): name' (py-spy --threads)
        name = thread.split(": ", 1)[1] if ": " in thread else thread
        name = re.sub(r"_\d+$", "", name)
        total += count
        by_thread[name] += count
        inner = "the engine's load" if name == "MainThread" else "?"
        for f in reversed(frames[1:]):
            fm = _FRAME.match(f.strip())
            file = fm.group("file") if fm else f
            if any(k in file for k in ("kvbridge/", "asyncio", "uvloop", "concurrent")):
                inner = f"{fm.group('fn') if fm else f} ({file.split('site-packages/')[-1].split('/work/')[-1]})"
                break
        by_fn[name][inner] += count
    print(f"{total} samples holding the GIL (imports left out)")
    for name, c in by_thread.most_common():
        print(f"{name}: {c / total:.1%}")
        for fn, k in by_fn[name].most_common(top):
            print(f"    {k / total:6.1%}  {fn}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", default="python", choices=["python", "native", "sleep"])
    ap.add_argument("--via", default="tcp", choices=["tcp", "ucx"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--summarize", metavar="RAW", help="summarize py-spy's raw output instead")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        run(args.load, args.via, args.repeats, args.tokens)


if __name__ == "__main__":
    main()
