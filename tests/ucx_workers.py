"""Processes of the multi-process UCX tests (started with multiprocessing
spawn).  Each runs one UcxAgent and obeys commands from a pipe."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import Any

import ucx_refpack as ref
from ucx_cases import TEST_PSK, make_cache

from kvbridge.layout import KVLayout


def _packer() -> Any:
    try:
        from kvbridge import pack

        return pack
    except ImportError:
        return ref


def digest(layout: KVLayout, cache: Any, bt: Any, start: int, end: int, layers: Any) -> str:
    w = ref.wire(ref.PagedKVCache(layout, cache), bt, start, end, layers)
    return hashlib.blake2b(w.tobytes(), digest_size=16).hexdigest()


def agent_main(
    conn: Any,
    env: dict[str, str],
    layout: KVLayout,
    pages: int,
    seed: int | None,
    error_mode: str,
    opts: dict[str, Any] | None = None,
) -> None:
    os.environ.update(env)
    asyncio.run(_serve(conn, layout, pages, seed, error_mode, opts or {}))


async def _serve(
    conn: Any, layout: KVLayout, pages: int, seed: int | None, error_mode: str, opts: dict[str, Any]
) -> None:
    from kvbridge.transport.ucx import UcxAgent

    loop = asyncio.get_running_loop()
    cache = make_cache(layout, pages, seed)
    opts.setdefault("psk", TEST_PSK)
    agent = UcxAgent(
        layout,
        cache,
        error_mode=error_mode,
        packer=_packer(),
        timeout=30.0,
        heartbeat=0.5,
        peer_timeout=3.0,
        **opts,
    )
    conn.send(("md", agent.metadata()))
    peers: list[Any] = []

    async def outcome(aw: Any, extra: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            st = await aw
            return ("ok", st.path, st.bytes, st.runs, *extra)
        except Exception as e:
            # the kvbridge class a caller catches (PeerGone for a UcxPeerError)
            kinds = [c.__name__ for c in type(e).__mro__]
            return ("error", type(e).__name__, str(e), time.time(), kinds)

    while True:
        cmd = await loop.run_in_executor(None, conn.recv)
        op = cmd[0]
        if op == "quit":
            break
        if op == "connect":
            peers.append(await agent.connect(cmd[1]))
            conn.send(("ok", peers[-1].same_layout))
        elif op == "expect_blocked":
            # expect, then block the loop (an application busy in C code):
            # the engine's progress thread must still answer the sender
            _, rid, bt, start, end, seconds = cmd
            h = agent.expect(rid, bt, start, end, timeout=30.0)
            conn.send(("blocking",))
            time.sleep(seconds)
            res = await outcome(h, ())
            conn.send(res)
        elif op == "expect":
            _, rid, bt, start, end, layers, timeout = cmd
            h = agent.expect(rid, bt, start, end, timeout=timeout)
            res = await outcome(h, ())
            if res[0] == "ok":
                res = (*res, digest(layout, cache, bt, start, end, layers))
            conn.send(res)
        elif op == "timed_send":
            _, rid, bt, rbt, start, end = cmd
            t0 = time.monotonic()
            res = await outcome(peers[0].send(rid, bt, rbt, start, end), ())
            conn.send((*res[:2], time.monotonic() - t0))
        elif op == "send":
            # ("send", [(peer index, rid, bt, remote bt, start, end, [layer ranges])...])
            jobs = []
            for idx, rid, bt, rbt, start, end, parts in cmd[1]:
                for layers in parts:
                    jobs.append(outcome(peers[idx].send(rid, bt, rbt, start, end, layers), (idx,)))
            results = await asyncio.gather(*jobs)
            conn.send(("sent", results))
        elif op == "send_forever":
            _, rid, bt, rbt, start, end = cmd
            conn.send(("started",))
            i = 0
            while True:
                i += 1
                res = await outcome(peers[0].send(f"{rid}{i}", bt, rbt, start, end), ())
                if res[0] != "ok":
                    conn.send(res)
                    break
        elif op == "digest":
            _, bt, start, end, layers = cmd
            conn.send(("digest", digest(layout, cache, bt, start, end, layers)))
    await agent.close()
