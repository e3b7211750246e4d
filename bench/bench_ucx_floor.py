"""The engine's floor under a small UCX ping-pong: the same 4 KiB prepared
send (``UcxPeer.prepare_send``) ping-ponged between two pinned processes,
driven two ways in the same pair, rounds interleaved:

* ``api``: as a user drives it, and as ``kvbridge-bench latency``'s
  prepared row does: ``post()`` returns a handle, the receiver polls its
  ``expect`` handle's ``done()`` and awaits it;
* ``engine``: the same expectations (registered through ``expect``, so the
  engine's ledger takes the DONEs), but the wait is the engine's
  ``poll_take`` and the post the engine's ``put_prepared``, with no handle
  on the path; the receive is accounted in Python after the reply left.

* ``post-api`` and ``wait-api``: the API on one half of the leg only (the
  post, or the wait), the engine's calls on the other.

The difference is what kvbridge's Python API costs a leg, and the two
hybrids say which half of it; ``engine`` is the UCX work (the CMA put, its
flush, the DONE, the poll that sees it) plus the engine's own bookkeeping.
A sample is half a round trip.

    python bench/bench_ucx_floor.py [--legs 20000] [--rounds 3] [--tls tcp+sm]

Under pytest a short run checks that both ways ping-pong and that every
page holds the other side's bytes afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import pytest

MODES = ("api", "engine", "post-api", "wait-api")


def _side(conn: Any, role: int, tls: str) -> None:
    os.environ["UCX_TLS"] = tls
    import numpy as np

    from kvbridge.cli import latency_peers as lp
    from kvbridge.cli.latency import side_cpus

    cpus = side_cpus("pinned")  # each side and its threads on a CPU of its own
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[role]})
    from kvbridge.transport.tcp import run

    lay = lp.page_layout(4096)

    async def main() -> None:
        agent, peer = await lp._ucx_pair(conn, role, lay, {}, fill=True)
        src, dst = np.array([1]), np.array([0])
        prepared = peer.prepare_send(src, dst, 0, 16)
        post = prepared.post
        eng, ep, prep, spin = agent._engine, peer.ep, prepared._prepared, agent.busy_poll_us
        me, them = ("a", "b") if role == 0 else ("b", "a")

        def take(he: Any) -> int:
            """Poll the engine until ``he``'s DONE completed it there: its
            bytes; -1 when it came through Python instead (a DONE that
            arrived before its expect is an early part, applied there)."""
            while True:
                got = eng.poll_take(0, he.token, 0)
                if got >= 0:
                    return int(got)
                if got == -2:  # something else is queued for Python: account it
                    agent._on_events()
                    if he.settled:
                        return -1

        async def wait(he: Any, api: bool) -> int:
            if api:  # as a user polls: done(), then the (resolved) handle
                while not he.done():
                    pass
                await he
                return -1
            return take(he)

        def send(rid: str, api: bool) -> None:
            if api:
                post(rid, timeout=30.0)
            else:
                eng.put_prepared(ep, prep, rid.encode(), spin)

        seq = 0
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            _, mode, n = cmd
            legs: list[float] = []
            post_api, wait_api = mode in ("api", "post-api"), mode in ("api", "wait-api")
            for _ in range(n):
                he = agent.expect(f"{them}{seq}", dst, 0, 16, timeout=30.0)
                tok, rid = he.token, f"{me}{seq}"
                if role == 0:
                    t0 = time.perf_counter()
                    send(rid, post_api)
                    got = await wait(he, wait_api)
                    legs.append((time.perf_counter() - t0) / 2)
                else:
                    got = await wait(he, wait_api)
                    send(rid, post_api)
                if got >= 0:  # accounted in Python after the reply left
                    agent.expectations.on_landed(tok, got, None, 0, True)
                await he  # resolved: the bytes are accounted
                seq += 1
            conn.send(("legs", legs))
        landed = bool((agent.cache[:, 0] == 2 - role).all())  # the other side's page 1
        conn.send(("landed", landed))
        await agent.close()

    run(main())


def measure(tls: str, legs: int, rounds: int) -> dict[str, list[float]]:
    """Half round trips (us) of each way, ``rounds`` interleaved rounds of
    ``legs`` legs each (the first tenth of each round left out)."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_side, args=(pipes[r][1], r, tls), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    a, b = pipes[0][0], pipes[1][0]
    out: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        info = [c.recv() for c in (a, b)]  # ("info", metadata)
        a.send(info[1][1])
        b.send(info[0][1])
        a.recv(), b.recv()  # ("ready",)
        for _ in range(rounds):
            for mode in MODES:
                for c in (a, b):
                    c.send(("run", mode, legs))
                if not (a.poll(120) and b.poll(120)):
                    raise TimeoutError("a side did not answer within 120 s")
                got, _ = a.recv(), b.recv()
                out[mode] += [x * 1e6 for x in got[1][legs // 10 :]]
        for c in (a, b):
            c.send(("quit",))
        if not all(c.poll(30) and c.recv()[1] for c in (a, b)):
            raise AssertionError("a page does not hold the other side's bytes")
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.mark.ucx
def test_both_ways_ping_pong() -> None:
    from kvbridge.transport import ucx

    if not ucx.available():
        pytest.skip(ucx.unavailable_reason())
    got = measure("tcp", 50, 1)
    for mode in MODES:
        assert len(got[mode]) == 45, mode
        assert all(x > 0 for x in got[mode]), mode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--legs", type=int, default=20000, help="legs per way per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--tls", default="tcp+sm", help="comma list; tcp+sm is UCX_TLS=tcp,sm")
    args = p.parse_args()
    print("# python bench/bench_ucx_floor.py " + " ".join(sys.argv[1:]))
    for tls in args.tls.split(","):
        tls = tls.replace("+", ",")
        got = measure(tls, args.legs, args.rounds)
        med = {m: statistics.median(got[m]) for m in MODES}
        for m in MODES:
            print(f"UCX {tls:7s} {m:8s} half round trip: median {med[m]:6.2f} us")
        print(f"UCX {tls:7s} api / engine: {med['api'] / med['engine']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
