"""Process bodies of ``kvbridge-bench latency``: two sides (A and B) per
configuration, started with multiprocessing spawn, that ping-pong one buffer
of ``size`` bytes.  Each leg completes when the receiver knows the bytes
landed (kvbridge: its expect completed; NIXL: its notification arrived; raw
uvloop: it read them), so half a round trip is one put-to-landed-at-receiver.
Side A also records the sender's own completion of each leg (kvbridge: the
send handle; NIXL: the transfer state DONE; both mean "flushed at the
target")."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError, TransferTimeout
from kvbridge.layout import DType, KVLayout


def page_layout(size: int) -> KVLayout:
    """One layer, one page of ``size`` bytes (an MLA 'latent head')."""
    return KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=size // 32,
        dtype=DType.FP16,
        page_tokens=16,
        mla=True,
        stacked=True,
        name=f"page{size}",
    )


def side_main(
    conn: Any,
    kind: str,
    role: int,
    env: dict[str, str],
    size: int,
    opts: dict[str, Any],
    cpu: int | None = None,
) -> None:
    """One side of a pair, in its own process; with ``cpu``, every thread of
    the process (those its imports started too) and every thread it starts
    run on that CPU only."""
    os.environ.update(env)
    if cpu is not None:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), {cpu})
    try:
        tree = opts.get("tree")
        if tree:  # another kvbridge source tree (the baseline): its own side runs
            _from_tree(str(tree))(conn, kind, role, env, size, opts)
            return
        _SIDES[kind](conn, role, size, opts)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def bench_module(tree: str, name: str) -> str:
    """The module path of the bench's ``cli.<name>`` in the source tree
    ``tree``: ``kvbridge_bench.cli.<name>`` (under ``kvbench/``) in trees
    after the library and the bench were split, ``kvbridge.cli.<name>`` in
    older ones."""
    if os.path.isdir(os.path.join(tree, "kvbench", "kvbridge_bench")):
        return f"kvbridge_bench.cli.{name}"
    return f"kvbridge.cli.{name}"


def import_from_tree(tree: str, module: str) -> Any:
    """``module`` of the kvbridge source tree ``tree`` (a checkout such as
    ``git archive <commit> | tar -x -C DIR``, its compiled ``kvbridge/*.so``
    copied in), imported in place of this one: this process forgets every
    kvbridge and kvbridge_bench module and the editable install's
    redirection, then imports from ``tree`` (and its ``kvbench/``) first,
    so do its later imports."""
    import importlib
    import sys

    if not os.path.isdir(os.path.join(tree, "kvbridge")):
        raise KVBridgeError(f"{tree} holds no kvbridge package")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    bench = os.path.join(tree, "kvbench")
    if os.path.isdir(bench):
        sys.path.insert(0, bench)
    sys.path.insert(0, tree)
    for name in [m for m in sys.modules if m.split(".")[0] in ("kvbridge", "kvbridge_bench")]:
        del sys.modules[name]
    mod = importlib.import_module(module)
    if not str(mod.__file__).startswith(os.path.abspath(tree)):
        raise KVBridgeError(f"{module} was imported from {mod.__file__}, not from {tree}")
    return mod


def _from_tree(tree: str) -> Any:
    """``side_main`` of the bench in the source tree ``tree``
    (:func:`import_from_tree`)."""
    mod = import_from_tree(tree, bench_module(tree, "latency_peers"))

    def side(
        conn: Any, kind: str, role: int, env: dict[str, str], size: int, opts: dict[str, Any]
    ) -> None:
        opts = {k: v for k, v in opts.items() if k != "tree"}
        if kind == "kvb-tcp-trace":  # a tree older than the trace: instrument it from here
            _kvb_tcp_trace(conn, role, size, opts)
            return
        mod.side_main(conn, kind, role, env, size, opts)

    return side


# ---- kvbridge UCX -----------------------------------------------------------------------
def _ucx_finisher(polling: bool) -> Any:
    """How a side waits for a handle: "await" awaits it (one loop hop when it
    resolves); "poll" polls done() as NIXL's users poll its notifications (no
    loop turn: done() progresses the worker and accounts what landed)."""

    async def finished(h: Any) -> None:
        if polling:
            end = time.monotonic() + 30.0
            while not h.done():
                if time.monotonic() > end:
                    raise TransferTimeout(f"{h.request_id!r} not done in 30 s")
        await h  # resolved when polled: returns (or raises) without yielding

    return finished


async def _ucx_pair(conn: Any, role: int, lay: Any, opts: dict[str, Any], fill: bool) -> Any:
    """This side's agent and its peer, connected through ``conn`` (side 0
    connects, side 1 waits for it); with ``fill``, the cache's page 1 holds
    the side's number."""
    from kvbridge.transport.ucx import UcxAgent

    cache = np.zeros(lay.cache_shape(2), dtype=np.uint16)
    if fill:
        cache[:, 1] = role + 1
    # the pair shares a key: UCX agents take only authenticated peers
    agent = UcxAgent(
        lay, cache, staging_bytes=0, min_put_run_bytes=0, psk=b"kvbridge bench pair", **opts
    )
    conn.send(("info", agent.metadata()))
    other = conn.recv()
    peer = await agent.connect(other) if role == 0 else None
    conn.send(("ready",))
    if role == 1:
        while not agent.peers:
            await asyncio.sleep(0.001)
        peer = agent.peers[0]
    assert peer is not None
    return agent, peer


async def _ucx_commands(conn: Any) -> Any:
    """The driver's commands to a UCX side: yields n for each ("samples"-
    producing) command, returns at "quit"."""
    loop = asyncio.get_running_loop()
    while True:
        cmd = await loop.run_in_executor(None, conn.recv)
        if cmd[0] == "quit":
            return
        yield cmd[1]


def _kvb_ucx(conn: Any, role: int, size: int, opts: dict[str, Any]) -> None:
    from kvbridge.transport.tcp import run

    lay = page_layout(size)
    opts = dict(opts)
    finished = _ucx_finisher(opts.pop("mode", "await") == "poll")
    prepared = bool(opts.pop("prepared", False))

    async def main() -> None:
        agent, peer = await _ucx_pair(conn, role, lay, opts, fill=True)
        src, dst = np.array([1]), np.array([0])
        # prepared: the runs made once, each post names its request
        post = peer.prepare_send(src, dst, 0, 16).post if prepared else None
        me, them = ("a", "b") if role == 0 else ("b", "a")
        seq = 0
        async for n in _ucx_commands(conn):
            one_way, sender = [], []
            for _ in range(n):
                he = agent.expect(f"{them}{seq}", dst, 0, 16, timeout=30.0)
                if role == 0:
                    t0 = time.perf_counter()
                    rid = f"{me}{seq}"
                    hs = (
                        post(rid, timeout=30.0)
                        if post
                        else peer.send(rid, src, dst, 0, 16, timeout=30.0)
                    )
                    await finished(hs)
                    t1 = time.perf_counter()
                    await finished(he)
                    one_way.append((time.perf_counter() - t0) / 2)
                    sender.append(t1 - t0)
                else:
                    await finished(he)
                    rid = f"{me}{seq}"
                    await finished(
                        post(rid, timeout=30.0)
                        if post
                        else peer.send(rid, src, dst, 0, 16, timeout=30.0)
                    )
                seq += 1
            conn.send(("samples", one_way, sender))
        await agent.close()

    run(main())


# ---- kvbridge UCX through the engine's calls: the floor under the API ----------------------
def _kvb_ucx_engine(conn: Any, role: int, size: int, opts: dict[str, Any]) -> None:
    """The prepared row's ping-pong with the engine's calls in place of the
    API on the post (``put_prepared``, no handle), on the wait
    (``poll_take`` on the expectation's token, accounted in Python after
    the reply left), or both: the difference to the prepared row is what
    the Python API costs a leg, and on which half."""
    from kvbridge.transport.tcp import run

    lay = page_layout(size)
    engine_post, engine_wait = bool(opts.pop("engine_post")), bool(opts.pop("engine_wait"))
    finished = _ucx_finisher(True)

    async def main() -> None:
        agent, peer = await _ucx_pair(conn, role, lay, opts, fill=True)
        src, dst = np.array([1]), np.array([0])
        prepared = peer.prepare_send(src, dst, 0, 16)
        eng, ep, prep, spin = agent._engine, peer._ep, prepared._prepared, agent._busy_poll_us
        me, them = ("a", "b") if role == 0 else ("b", "a")

        def take(he: Any) -> int:
            """Poll the engine until ``he``'s DONE completed it there: its
            bytes; -1 when it came through Python instead (a DONE that
            arrived before its expect is an early part, applied by the loop
            or here: ``he`` may be settled from the start)."""
            while not he.settled:
                got = eng.poll_take(0, he.token, 0)
                if got >= 0:
                    return int(got)
                if got == -2:  # something else is queued for Python: account it
                    agent._on_events()
            return -1

        async def wait(he: Any) -> int:
            if engine_wait:
                return take(he)
            await finished(he)  # done() polled, then the resolved handle
            return -1

        def send(rid: str) -> None:
            if engine_post:
                eng.put_prepared(ep, prep, rid.encode(), spin)
            else:
                prepared.post(rid, timeout=30.0)

        seq = 0
        async for n in _ucx_commands(conn):
            one_way, sender = [], []
            for _ in range(n):
                he = agent.expect(f"{them}{seq}", dst, 0, 16, timeout=30.0)
                if role == 0:
                    t0 = time.perf_counter()
                    send(f"{me}{seq}")
                    t1 = time.perf_counter()
                    got = await wait(he)
                    one_way.append((time.perf_counter() - t0) / 2)
                    sender.append(t1 - t0)
                else:
                    got = await wait(he)
                    send(f"{me}{seq}")
                if got >= 0:  # accounted in Python after the reply left
                    agent._expectations.on_landed(he.token, got, None, 0, True)
                await he
                seq += 1
            if not (agent._cache[:, 0] == 2 - role).all():  # the other side's page 1
                raise KVBridgeError("the landing page does not hold the other side's bytes")
            conn.send(("samples", one_way, sender))
        await agent.close()

    run(main())


# ---- kvbridge UCX, traced: where the time of one small put goes, over two processes ----------
def _kvb_ucx_trace(conn: Any, role: int, size: int, opts: dict[str, Any]) -> None:
    """Side 0 (A) and side 1 (B) ping-pong as in ``_kvb_ucx``, stamping on
    the monotonic clock both processes share: A's ``send()`` called and
    returned, each expect resolved (``stats.finished``), each task resumed
    after it, B's ``send()`` called and returned."""
    from kvbridge.transport.tcp import run

    lay = page_layout(size)
    opts = dict(opts)
    finished = _ucx_finisher(opts.pop("mode", "await") == "poll")
    now = time.monotonic

    async def main() -> None:
        agent, peer = await _ucx_pair(conn, role, lay, opts, fill=False)
        src, dst = np.array([1]), np.array([0])
        me, them = ("a", "b") if role == 0 else ("b", "a")
        seq = 0
        async for n in _ucx_commands(conn):
            stamps: list[tuple[float, ...]] = []
            for _ in range(n):
                he = agent.expect(f"{them}{seq}", dst, 0, 16, timeout=30.0)
                if role == 0:
                    t0 = now()
                    hs = peer.send(f"{me}{seq}", src, dst, 0, 16, timeout=30.0)
                    t1 = now()
                    await finished(hs)
                    await finished(he)
                    stamps.append((t0, t1, he.stats.finished, now()))
                else:
                    await finished(he)
                    t0 = now()
                    hs = peer.send(f"{me}{seq}", src, dst, 0, 16, timeout=30.0)
                    t1 = now()
                    await finished(hs)
                    stamps.append((he.stats.finished, t0, t1))
                seq += 1
            conn.send(("samples", stamps, []))
        await agent.close()

    run(main())


# ---- kvbridge TCP -----------------------------------------------------------------------
def _kvb_tcp(conn: Any, role: int, size: int, opts: dict[str, Any]) -> None:
    from kvbridge.transport.tcp import BytesSink, BytesSource, TcpReceiver, TcpSender, run

    count = int(opts.get("count", 4096))

    async def main() -> None:
        rx = await TcpReceiver("127.0.0.1", 0).start()
        sinks = [BytesSink(size) for _ in range(count)]
        me, them = ("a", "b") if role == 0 else ("b", "a")
        expects = [rx.expect(f"{them}{i}", sinks[i], timeout=3600.0) for i in range(count)]
        conn.send(("info", (rx.port, [h.token for h in expects])))
        port, tokens = conn.recv()
        tx = await TcpSender("127.0.0.1", port, streams=1, compression="off").connect()
        conn.send(("ready",))
        payload = BytesSource(np.full(size, role + 1, dtype=np.uint8))
        seq = 0
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "quit":
                break
            n = cmd[1]
            if seq + n > count:
                conn.send(("error", f"more than {count} samples"))
                break
            one_way, sender = [], []
            for _ in range(n):
                if role == 0:
                    t0 = time.perf_counter()
                    hs = tx.send(f"{me}{seq}", payload, token=tokens[seq], timeout=30.0)
                    await hs.wait(30.0)
                    t1 = time.perf_counter()
                    await expects[seq].wait(30.0)
                    one_way.append((time.perf_counter() - t0) / 2)
                    sender.append(t1 - t0)
                else:
                    await expects[seq].wait(30.0)
                    await tx.send(f"{me}{seq}", payload, token=tokens[seq], timeout=30.0).wait(30.0)
                seq += 1
            conn.send(("samples", one_way, sender))
        await tx.close()
        await rx.close()

    run(main())


# ---- kvbridge TCP, traced: where the time of one small transfer goes ---------------------------
def _instrument(log: list[tuple[float, str]]) -> None:
    """Record, with the time, each frame sent and read, each handle resolved,
    each task created and each hop to a worker thread (its start and end in
    the thread), by wrapping those methods in this process.  The clock is
    the machine's monotonic clock, shared by both processes."""
    import concurrent.futures

    from kvbridge.transport.handle import TransferHandleBase
    from kvbridge.transport.tcp.conn import FrameConnection

    now = time.perf_counter

    def wrap(cls: Any, name: str, label: Any) -> None:
        f = getattr(cls, name)

        def w(self: Any, *a: Any, **k: Any) -> Any:
            log.append((now(), label(self, *a)))
            return f(self, *a, **k)

        setattr(cls, name, w)

    wrap(FrameConnection, "send", lambda c, m: f"send {type(m).__name__}")
    wrap(FrameConnection, "buffer_updated", lambda c, n: "socket read")
    wrap(FrameConnection, "_dispatch", lambda c, m: f"got {type(m).__name__}")
    wrap(TransferHandleBase, "_resolve", lambda h, e: f"{type(h).__name__} resolved")
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def hop(self: Any, fn: Any, *a: Any, **k: Any) -> Any:
        name = getattr(fn, "__name__", type(fn).__name__)
        log.append((now(), f"to a worker thread: {name}"))

        def body(*a: Any, **k: Any) -> Any:
            log.append((now(), f"  in the thread: {name}"))
            try:
                return fn(*a, **k)
            finally:
                log.append((now(), "  back from the thread"))

        return submit(self, body, *a, **k)

    concurrent.futures.ThreadPoolExecutor.submit = hop  # type: ignore[method-assign,assignment]


def _kvb_tcp_trace(conn: Any, role: int, size: int, opts: dict[str, Any]) -> None:
    """Side 0 sends transfers one at a time to side 1 (each after the last
    completed), both recording :func:`_instrument`'s events."""
    from kvbridge.transport.tcp import BytesSink, BytesSource, TcpReceiver, TcpSender, run

    count = int(opts.get("count", 4096))
    log: list[tuple[float, str]] = []
    _instrument(log)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        factory = loop.get_task_factory()

        def task(lp: Any, coro: Any, **kw: Any) -> Any:
            log.append((time.perf_counter(), "task created"))
            if factory is not None:
                return factory(lp, coro, **kw)
            return asyncio.Task(coro, loop=lp, **kw)

        rx = tx = None
        if role == 1:
            rx = await TcpReceiver("127.0.0.1", 0).start()
            hs = [rx.expect(f"t{i}", BytesSink(size), timeout=3600.0) for i in range(count)]
            conn.send(("info", (rx.port, [h.token for h in hs])))
            conn.recv()
        else:
            conn.send(("info", None))
            port, tokens = conn.recv()
            tx = await TcpSender("127.0.0.1", port, streams=1, compression="off").connect()
        conn.send(("ready",))
        payload = BytesSource(np.full(size, 1, dtype=np.uint8))
        seq = 0
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "quit":
                break
            log.clear()
            loop.set_task_factory(task)
            for _ in range(cmd[1]):
                if role == 0:
                    assert tx is not None
                    await asyncio.sleep(0.002)  # the receiver idle again
                    log.append((time.perf_counter(), "send() called"))
                    await tx.send(f"t{seq}", payload, token=tokens[seq], timeout=30.0).wait(30.0)
                    log.append((time.perf_counter(), "send handle awaited"))
                else:
                    await hs[seq].wait(30.0)
                    log.append((time.perf_counter(), "expect handle awaited"))
                seq += 1
            loop.set_task_factory(factory)
            conn.send(("samples", list(log), []))
        if tx is not None:
            await tx.close()
        if rx is not None:
            await rx.close()

    run(main())


# ---- raw uvloop ping-pong ---------------------------------------------------------------------
def _uvloop(conn: Any, role: int, size: int, opts: dict[str, Any]) -> None:
    from kvbridge.transport.tcp import run

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            loop.create_future()
        )
        server = None
        if role == 1:

            async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                ready.set_result((r, w))

            server = await asyncio.start_server(accept, "127.0.0.1", 0)
            conn.send(("info", server.sockets[0].getsockname()[1]))
            conn.recv()
            conn.send(("ready",))
            reader, writer = await ready
        else:
            conn.send(("info", None))
            port = conn.recv()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            conn.send(("ready",))
        import socket

        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = bytes([role + 1]) * size
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "quit":
                break
            one_way: list[float] = []
            for _ in range(cmd[1]):
                if role == 0:
                    t0 = time.perf_counter()
                    writer.write(payload)
                    await reader.readexactly(size)
                    one_way.append((time.perf_counter() - t0) / 2)
                else:
                    await reader.readexactly(size)
                    writer.write(payload)
            conn.send(("samples", one_way, []))
        writer.close()
        if server is not None:
            server.close()

    run(main())


# ---- NIXL -------------------------------------------------------------------------------------
def _nixl(conn: Any, role: int, size: int, opts: dict[str, Any]) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    name = f"lat{role}"
    agent = nixl_agent(
        name,
        nixl_agent_config(enable_prog_thread=bool(opts.get("progress_thread", False)), backends=[]),
    )
    agent.create_backend("UCX", dict(opts.get("params", {})))
    buf = np.full(2 * size, role + 1, dtype=np.uint8)  # [0, size): landing; [size, 2 size): source
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send(("info", (agent.get_agent_metadata(), buf.ctypes.data)))
    md, remote_base = conn.recv()
    other = agent.add_remote_agent(md)
    local = agent.get_xfer_descs(
        np.array([[buf.ctypes.data + size, size, 0]], dtype=np.uint64), "DRAM"
    )
    remote = agent.get_xfer_descs(np.array([[remote_base, size, 0]], dtype=np.uint64), "DRAM")
    per_request = bool(opts.get("per_request", False))
    if per_request:
        # As vLLM's NIXL connector drives it: descriptor lists prepared once,
        # one transfer handle per request (make_prepped_xfer with the request
        # id as its notification), released when DONE; the receiver looks
        # for that id among its notifications.
        local_dl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local)
        remote_dl = agent.prep_xfer_dlist(other, remote)
        handle = None
    else:
        handle = agent.initialize_xfer("WRITE", local, remote, other, b"x")
    conn.send(("ready",))
    deadline_s = 30.0
    seen: set[bytes] = set()

    def wait_notif(want: bytes) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            for notifs in agent.get_new_notifs().values():
                seen.update(notifs)
            if not per_request and seen:
                seen.clear()
                return
            if want in seen:
                seen.discard(want)
                return
        raise TransferTimeout("no NIXL notification")

    def post(rid: bytes) -> Any:
        h = handle
        if per_request:
            h = agent.make_prepped_xfer("WRITE", local_dl, [0], remote_dl, [0], rid)
        if agent.transfer(h) not in ("PROC", "DONE"):
            raise KVBridgeError("NIXL transfer failed to post")
        return h

    def wait_done(h: Any) -> None:
        end = time.monotonic() + deadline_s
        state = "PROC"
        while state == "PROC" and time.monotonic() < end:
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise KVBridgeError(f"NIXL transfer state {state}")
        if per_request:
            agent.release_xfer_handle(h)

    me, them = (b"a", b"b") if role == 0 else (b"b", b"a")
    seq = 0
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        one_way, sender = [], []
        for _ in range(cmd[1]):
            tag = str(seq).encode()
            if role == 0:
                t0 = time.perf_counter()
                wait_done(post(me + tag))
                t1 = time.perf_counter()
                wait_notif(them + tag)
                one_way.append((time.perf_counter() - t0) / 2)
                sender.append(t1 - t0)
            else:
                wait_notif(them + tag)
                wait_done(post(me + tag))
            seq += 1
        conn.send(("samples", one_way, sender))
    if per_request:
        agent.release_dlist_handle(local_dl)
        agent.release_dlist_handle(remote_dl)
    else:
        agent.release_xfer_handle(handle)


_SIDES = {
    "kvb-ucx": _kvb_ucx,
    "kvb-ucx-engine": _kvb_ucx_engine,
    "kvb-ucx-trace": _kvb_ucx_trace,
    "kvb-tcp": _kvb_tcp,
    "kvb-tcp-trace": _kvb_tcp_trace,
    "uvloop": _uvloop,
    "nixl": _nixl,
}
