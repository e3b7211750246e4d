"""An await that starts late: how long after the sender's ``send()`` call
the receiver's handle resolves, when the receiver created its ``expect``
earlier (its loop's poll window has ended, the engine's progress thread
spins) and starts awaiting just before the data comes.

Each sample, on the monotonic clock both processes share: the receiver
expects at T, awaits at T + 1.5 ms (its inline spin polls the worker for
50 us and ends empty), the sender calls ``send()`` at T + 1.7 ms; the sample
is the receiver's ``stats.finished`` minus the sender's call.  This is the
hand-over from an inline poller back to the progress thread: a thread that
stood down for the poller must take over as soon as it leaves, or what
arrives next waits for the thread's own timeout (1 ms).

    python bench/bench_ucx_late_await.py [--samples 300] [--tls tcp,tcp+sm] [--baseline DIR]

``--baseline DIR``: a kvbridge source tree (``git archive <commit> kvbridge
| tar -x -C DIR``, with the compiled ``kvbridge/*.so`` copied into it) whose
rows run interleaved with the current ones.  Under pytest a short run checks
that every sample resolves with the sender's bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import pytest

AWAIT_AT = 0.0015  # the receiver starts awaiting, after its expect
SEND_AT = 0.0017  # the sender calls send()


def _side(conn: Any, role: int, tls: str, tree: str | None, samples: int) -> None:
    os.environ["UCX_TLS"] = tls
    import numpy as np

    from kvbridge_bench.cli import latency_peers as lp

    if tree:  # the baseline's kvbridge, not this one
        lp = lp.import_from_tree(tree, "kvbridge_bench.cli.latency_peers")
    from kvbridge.transport.tcp import run

    lay = lp.page_layout(4096)
    now = time.monotonic

    async def until(t: float) -> None:
        while now() < t:
            await asyncio.sleep(0)

    async def main() -> None:
        agent, peer = await lp._ucx_pair(conn, role, lay, {}, fill=True)
        src, dst = np.array([1]), np.array([0])
        for seq in range(samples):
            t0 = conn.recv()
            if role == 1:
                await until(t0)
                h = agent.expect(f"late{seq}", dst, 0, 16, timeout=30.0)
                await until(t0 + AWAIT_AT)
                st = await h
                landed = bool((agent._cache[:, 0] == 1).all())  # the sender's page 1 holds 1
                agent._cache[:, 0] = 0
                conn.send((st.finished, landed))
            else:
                await until(t0 + SEND_AT)
                called = now()
                await peer.send(f"late{seq}", src, dst, 0, 16, timeout=30.0)
                conn.send((called, True))
        await agent.close()

    run(main())


def measure(tls: str, samples: int, tree: str | None = None) -> list[float]:
    """Microseconds from the sender's send() call to the receiver's
    resolution, one per sample after the first tenth (the warm-up)."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [
        ctx.Process(target=_side, args=(pipes[r][1], r, tls, tree, samples), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    a, b = pipes[0][0], pipes[1][0]
    try:
        info = [c.recv() for c in (a, b)]  # ("info", metadata)
        a.send(info[1][1])
        b.send(info[0][1])
        a.recv(), b.recv()  # ("ready",)
        out = []
        for _ in range(samples):
            t0 = time.monotonic() + 0.01
            a.send(t0)
            b.send(t0)
            if not (a.poll(30) and b.poll(30)):
                raise TimeoutError("a side did not answer within 30 s")
            (called, _), (finished, landed) = a.recv(), b.recv()
            if not landed:
                raise AssertionError("the receiver's page does not hold the sender's bytes")
            out.append((finished - called) * 1e6)
        return out[samples // 10 :]  # the first tenth warms up
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _row(name: str, xs: list[float]) -> str:
    s = sorted(xs)
    p90 = s[int(len(s) * 0.9)]
    return f"{name:34s} median {statistics.median(s):7.1f} us   P90 {p90:7.1f} us   max {s[-1]:7.1f} us"


@pytest.mark.ucx
def test_late_await_lands() -> None:
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(ucx.unavailable_reason())
    xs = measure("tcp", 20)
    assert len(xs) == 18
    print("\n" + _row("kvbridge UCX tcp", xs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--tls", default="tcp,tcp+sm", help="comma list; tcp+sm is UCX_TLS=tcp,sm")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per row")
    p.add_argument("--baseline", metavar="DIR", help="a kvbridge source tree run beside this one")
    args = p.parse_args()
    print("# python bench/bench_ucx_late_await.py " + " ".join(sys.argv[1:]))
    trees: list[tuple[str, str | None]] = [("kvbridge", None)]
    if args.baseline:
        trees.insert(0, ("baseline", args.baseline))
    for tls in args.tls.split(","):
        tls = tls.replace("+", ",")
        got: dict[str, list[float]] = {name: [] for name, _ in trees}
        for _ in range(args.rounds):
            for name, tree in trees:
                got[name] += measure(tls, args.samples, tree)
        for name, _ in trees:
            print(_row(f"{name} UCX {tls}", got[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
