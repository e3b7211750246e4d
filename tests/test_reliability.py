"""Self-healing: a decode peer killed (SIGKILL) and restarted in a loop, a
new process with the same identity and address, while transfers run; the
survivor (a PrefillBridge in this process) is never restarted.

For TCP and for UCX (``UCX_TLS=tcp``; the decode serves its metadata on a
control port, ``DecodeBridge(ucx_control=...)``, and the prefill connects
by that address), each of 5 rounds checks that

* every transfer in flight when the peer is killed either completes with the
  right bytes (by hash, as the receiver saw them) or fails with a typed
  kvbridge error within its deadline (plus a small slack);
* after each restart, new transfers to the same destination name complete
  with the right bytes: the survivor reconnected by itself (TCP: its
  sender's connections re-open to the same address; UCX: the dead peer was
  dropped and the next send fetched the new metadata and connected again).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from typing import Any

import numpy as np
import pytest
from decode_proc import PAGES, DecodeProc, layout
from tcp_support import arun

from kvbridge.errors import KVBridgeError

pytest.importorskip("kvbridge._core")
pytestmark = pytest.mark.timeout(600)  # processes started and killed: minutes on a loaded VM

DEADLINE = 15.0  # every transfer's own deadline
SLACK = 5.0
RESTARTS = 5


def _transports() -> list[Any]:
    from kvbridge.transport import ucx

    ucx_ok = ucx.available()
    return [
        "tcp",
        pytest.param(
            "ucx",
            marks=pytest.mark.skipif(
                not ucx_ok, reason=f"UCX unavailable: {ucx.unavailable_reason()}"
            ),
        ),
    ]


async def restart_loop(kind: str, restarts: int) -> dict[str, Any]:
    from kvbridge import pack
    from kvbridge.bridge import PeerConfig, PrefillBridge

    lay = layout()
    rng = random.Random(kind)
    src = pack.PagedKVCache.allocate(lay, PAGES, fill="random", seed=3)
    peer = DecodeProc(kind)
    await peer.start()
    pre = PrefillBridge(src, identity="p")
    if kind == "tcp":
        cfg = PeerConfig("tcp", "127.0.0.1", peer.port, streams=2, connect_timeout=10,
                         reconnect_timeout=30, keepalive_interval=0.5, keepalive_timeout=3.0)  # fmt: skip
    else:
        cfg = PeerConfig("ucx", "127.0.0.1", peer.port, connect_timeout=10)
    tally: dict[str, Any] = {"after_restart_ok": 0, "killed_ok": 0, "killed_failed": {}}
    free = set(range(PAGES))  # destination pages: concurrent transfers never share one

    async def one(rid: str, must: bool) -> str:
        n = rng.randint(200, 3000)
        need = lay.pages_for(n)
        st = np.asarray(rng.sample(range(PAGES), need), np.int32)
        mt = rng.sample(sorted(free), need)
        free.difference_update(mt)
        try:
            return await sent(rid, n, st, mt, must)
        finally:
            free.update(mt)

    async def sent(rid: str, n: int, st: Any, mt: list[int], must: bool) -> str:
        ticket, rx_f = await peer.expect(rid, mt, n, DEADLINE)
        if ticket is None:
            assert not must, f"{kind} {rid}: the restarted peer took no expectation"
            return "peer down"
        want = hashlib.sha256(bytes(np.asarray(pack.pack(src, st, 0, n)))).hexdigest()
        t0 = time.monotonic()
        res: Any = None
        try:
            d = pre.send(rid, st, {"d": ticket}, timeout=DEADLINE)
            await d.wait(DEADLINE + SLACK)
        except KVBridgeError as e:
            res = e
        took = time.monotonic() - t0
        if res is not None:
            assert took <= DEADLINE + SLACK, f"{kind} {rid}: {res!r} only after {took:.1f} s"
        rx = await asyncio.wait_for(rx_f, DEADLINE + 2 * SLACK)
        if rx.get("done") == "ok":
            assert rx["sha"] == want, f"{kind} {rid}: the destination bytes differ"
        if must:
            assert res is None, f"{kind} {rid}: after a restart the send failed: {res!r}"
            assert rx.get("done") == "ok", f"{kind} {rid}: sender ok, receiver {rx}"
            return "ok"
        if res is None:
            # done at the sender: the receiver confirmed it or died right after
            assert rx.get("done") in ("ok", "peer process died"), f"{kind} {rid}: receiver {rx}"
            return "ok"
        return type(res).__name__

    try:
        await pre.connect("d", cfg)
        for r in range(restarts + 1):
            for i in range(2):
                assert await one(f"r{r}-ok{i}", must=True) == "ok"
                if r:
                    tally["after_restart_ok"] += 1
            if r == restarts:
                break
            # transfers in flight while the peer is killed and restarted
            tasks = [asyncio.ensure_future(one(f"r{r}-kill{i}", must=False)) for i in range(3)]
            await asyncio.sleep(rng.uniform(0.0, 0.03))
            peer.kill()
            await peer.start()
            for what in await asyncio.gather(*tasks):
                if what == "ok":
                    tally["killed_ok"] += 1
                else:
                    tally["killed_failed"][what] = tally["killed_failed"].get(what, 0) + 1
    finally:
        await pre.close()
        peer.close()
    return tally


@pytest.mark.parametrize("kind", _transports())
def test_peer_killed_and_restarted_is_reconnected(kind: str) -> None:
    tally = arun(restart_loop(kind, RESTARTS), 600)
    print(f"{kind}: {tally}")
    assert tally["after_restart_ok"] == 2 * RESTARTS
