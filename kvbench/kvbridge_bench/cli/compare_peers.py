"""Process bodies of ``kvbridge-bench compare``: one receiver and one sender
per library, started with multiprocessing spawn, that stay up for a whole
scenario and move a burst of transfers on each command, so that the rows of a
run take turns.  Every library moves the same pieces (one per page, layer and
K/V component) between the same two buffers; kvbridge is given the block
tables instead and coalesces them itself.

The commands, over each side's pipe (the parent's ``Pair`` drives them):

- both sides first send ``("info", x)``; the parent hands the receiver's
  ``x`` to the sender (``("peer", x)``), then each side answers
  ``("ready",)``;
- receiver ``("arm", n, tag)``: zero the destination buffer, get ready for
  ``n`` transfers (kvbridge: expect them), answer ``("armed",)``;
- sender ``("run", n, tag)``: move ``n`` transfers, each timed from its post
  until the sender knows the bytes landed; answer ``("times", [seconds])``;
- receiver ``("check",)``: once all ``n`` landed (kvbridge: its expects
  completed; NIXL: its notifications arrived; ucxx: its receives completed),
  answer ``("digest", hex)`` of the destination pieces;
- sender ``("digest",)``: the digest of the source pieces;
- ``("quit",)``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import InvalidArgument, KVBridgeError, TransferTimeout, Unavailable
from kvbridge.layout import KVLayout
from kvbridge.transport.tcp import run

BURST_DEADLINE = 600.0  # seconds, every wait of a side


@dataclass(frozen=True)
class Scenario:
    name: str
    layout: KVLayout  # stacked: one region per side
    num_pages: int
    src_bt: np.ndarray
    dst_bt: np.ndarray
    start: int
    end: int
    bulk: bool = False  # one contiguous piece (the pieces merged)

    @property
    def region_bytes(self) -> int:
        return (
            self.layout.layer_numel(self.num_pages) * self.layout.itemsize * self.layout.num_layers
        )

    def pieces(self, bt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from kvbridge.transport.ucx.runs import CacheGeometry, page_pieces

        _, off, length = page_pieces(
            CacheGeometry(self.layout, self.num_pages), bt, self.start, self.end
        )
        if self.bulk and length.size:
            if not np.array_equal(off[1:], off[:-1] + length[:-1]):
                raise InvalidArgument("a bulk scenario needs contiguous pages")
            return off[:1], np.array([int(length.sum())], dtype=length.dtype)
        return off, length

    @property
    def nbytes(self) -> int:
        return self.layout.wire_nbytes(self.end - self.start)


def scenario_buffer(scen: Scenario, fill: bool) -> np.ndarray:
    buf = np.zeros(scen.region_bytes, dtype=np.uint8)
    if fill:
        words = buf.view(np.uint64)
        words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return buf


def pieces_digest(buf: np.ndarray, off: np.ndarray, length: np.ndarray) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    mv = memoryview(buf.data)
    for o, n in zip(off.tolist(), length.tolist(), strict=True):
        h.update(mv[o : o + n])
    return h.hexdigest()


def side_main(
    conn: Any, role: int, env: dict[str, str], lib: str, scen: Scenario, opts: dict[str, Any]
) -> None:
    """Role 0 sends, role 1 receives."""
    os.environ.update(env)
    try:
        _SIDES[lib][role](conn, scen, opts)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


class _Side:
    """What every side shares: the buffer, the pipe, the digest."""

    def __init__(self, conn: Any, scen: Scenario, role: int) -> None:
        self.conn = conn
        self.scen = scen
        self.buf = scenario_buffer(scen, fill=role == 0)
        self.off, self.length = scen.pieces(scen.src_bt if role == 0 else scen.dst_bt)

    def digest(self) -> str:
        return pieces_digest(self.buf, self.off, self.length)

    def zero(self) -> None:
        mv = self.buf
        for o, n in zip(self.off.tolist(), self.length.tolist(), strict=True):
            mv[o : o + n] = 0


def _serve_sender(conn: Any, side: _Side, one: Callable[[], None]) -> None:
    """A blocking sender's command loop: say ready, then time ``one()`` (one
    whole transfer) ``n`` times per ``run``, report its digest, until ``quit``."""
    conn.send(("ready",))
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        if cmd[0] == "digest":
            conn.send(("digest", side.digest()))
        elif cmd[0] == "run":
            times = []
            for _ in range(cmd[1]):
                t = time.perf_counter()
                one()
                times.append(time.perf_counter() - t)
            conn.send(("times", times))


def _deadline_passed(t0: float, what: str) -> None:
    if time.monotonic() - t0 > BURST_DEADLINE:
        raise TransferTimeout(f"{what} not done within {BURST_DEADLINE} s")


# ---- kvbridge ------------------------------------------------------------------------
def kvb_cache_view(buf: np.ndarray, scen: Scenario) -> np.ndarray:
    lay = scen.layout
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32}[lay.itemsize]
    return buf.view(dt).reshape(lay.cache_shape(scen.num_pages))


def _kvb_agent(side: _Side, opts: dict[str, Any]) -> Any:
    from kvbridge.transport.ucx import UcxAgent

    return UcxAgent(
        side.scen.layout,
        kvb_cache_view(side.buf, side.scen),
        staging_bytes=0,
        timeout=300,
        psk=b"kvbridge bench pair",  # UCX agents take only authenticated peers
        **opts,
    )


def _kvb_receiver(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    side = _Side(conn, scen, 1)

    async def main() -> None:
        agent = _kvb_agent(side, opts)
        conn.send(("info", agent.metadata()))
        loop = asyncio.get_running_loop()
        conn.send(("ready",))
        handles: list[Any] = []
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "quit":
                break
            if cmd[0] == "arm":
                side.zero()
                n, tag = cmd[1], cmd[2]
                handles = [
                    agent.expect(f"{tag}.{i}", scen.dst_bt, scen.start, scen.end) for i in range(n)
                ]
                conn.send(("armed",))
            elif cmd[0] == "check":
                for h in handles:
                    await h
                conn.send(("digest", side.digest()))
        await agent.close()

    run(main())


def _kvb_sender(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    side = _Side(conn, scen, 0)

    async def main() -> None:
        agent = _kvb_agent(side, opts)
        conn.send(("info", None))
        loop = asyncio.get_running_loop()
        peer = await agent.connect((await loop.run_in_executor(None, conn.recv))[1])
        conn.send(("ready",))
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "quit":
                break
            if cmd[0] == "digest":
                conn.send(("digest", side.digest()))
            elif cmd[0] == "run":
                times = []
                for i in range(cmd[1]):
                    t = time.perf_counter()
                    await peer.send(f"{cmd[2]}.{i}", scen.src_bt, scen.dst_bt, scen.start, scen.end)
                    times.append(time.perf_counter() - t)
                conn.send(("times", times))
        await agent.close()

    run(main())


# ---- raw ucxx: one contiguous buffer of the same size -------------------------------
def _ucxx_receiver(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    import ucxx

    async def main() -> None:
        flat = np.zeros(scen.nbytes, dtype=np.uint8)  # one contiguous buffer, not the pages
        eps: asyncio.Queue[Any] = asyncio.Queue()

        async def serve(ep: Any) -> None:
            await eps.put(ep)
            await closed.wait()

        closed = asyncio.Event()
        listener = ucxx.create_listener(serve)
        conn.send(("info", listener.port))
        loop = asyncio.get_running_loop()
        ep = await asyncio.wait_for(eps.get(), 60)
        conn.send(("ready",))
        task: asyncio.Task[None] | None = None
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "quit":
                break
            if cmd[0] == "arm":
                flat[:] = 0
                n = cmd[1]

                async def receive(n: int = n) -> None:
                    for _ in range(n):
                        await ep.recv(flat)
                    # the sender's last send completes after this ack, not before
                    await ep.send(np.ones(1, dtype=np.uint8))

                task = asyncio.ensure_future(receive())
                conn.send(("armed",))
            elif cmd[0] == "check":
                assert task is not None
                await asyncio.wait_for(task, BURST_DEADLINE)
                conn.send(
                    ("digest", pieces_digest(flat, np.zeros(1, np.int64), np.array([flat.size])))
                )
        closed.set()
        listener.close()

    run(main())


def _ucxx_sender(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    import ucxx

    side = _Side(conn, scen, 0)

    async def main() -> None:
        conn.send(("info", None))
        loop = asyncio.get_running_loop()
        port = (await loop.run_in_executor(None, conn.recv))[1]
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        flat = np.concatenate(
            [
                side.buf[o : o + n]
                for o, n in zip(side.off.tolist(), side.length.tolist(), strict=True)
            ]
        )
        conn.send(("ready",))
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd[0] == "quit":
                break
            if cmd[0] == "digest":
                conn.send(
                    ("digest", pieces_digest(flat, np.zeros(1, np.int64), np.array([flat.size])))
                )
            elif cmd[0] == "run":
                times = []
                for _ in range(cmd[1]):
                    t = time.perf_counter()
                    await ep.send(flat)
                    times.append(time.perf_counter() - t)
                await ep.recv(np.empty(1, dtype=np.uint8))
                conn.send(("times", times))

    run(main())


# ---- NIXL (UCX backend, DRAM descriptors) ----------------------------------------------
def _nixl_agent(name: str, opts: dict[str, Any]) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=opts.get("progress_thread", True), backends=[])
    agent = nixl_agent(name, cfg)
    agent.create_backend("UCX", dict(opts.get("params", {})))
    return agent


def _nixl_receiver(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    side = _Side(conn, scen, 1)
    agent = _nixl_agent("kvb-target", opts)
    agent.register_memory([(side.buf.ctypes.data, side.buf.nbytes, 0, "")], "DRAM")
    conn.send(("info", (agent.get_agent_metadata(), side.buf.ctypes.data)))
    conn.send(("ready",))
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        if cmd[0] != "arm":
            continue
        side.zero()
        n = cmd[1]
        conn.send(("armed",))
        # Without a progress thread the target progresses while it waits for
        # the notifications (get_new_notifs), as NIXL's examples do; the
        # sender posts every transfer with one.
        got, t0, spins = 0, time.monotonic(), 0
        while got < n:
            got += sum(len(v) for v in agent.get_new_notifs().values())
            spins += 1
            if opts.get("progress_thread", True) and got < n:
                time.sleep(0.001)
            if spins % 4096 == 0:
                _deadline_passed(t0, "NIXL notifications")
        cmd = conn.recv()
        assert cmd[0] == "check"
        conn.send(("digest", side.digest()))


def _nixl_sender(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    side = _Side(conn, scen, 0)
    agent = _nixl_agent("kvb-initiator", opts)
    agent.register_memory([(side.buf.ctypes.data, side.buf.nbytes, 0, "")], "DRAM")
    conn.send(("info", None))
    md, dst_base = conn.recv()[1]
    remote = agent.add_remote_agent(md)
    doff, _ = scen.pieces(scen.dst_bt)
    zeros = np.zeros_like(side.length)
    local = agent.get_xfer_descs(
        np.stack([side.off + side.buf.ctypes.data, side.length, zeros], 1), "DRAM"
    )
    rem = agent.get_xfer_descs(np.stack([doff + dst_base, side.length, zeros], 1), "DRAM")
    handle = agent.initialize_xfer("WRITE", local, rem, remote, b"kvb")

    def one() -> None:
        t = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC" and time.perf_counter() - t < BURST_DEADLINE:
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise KVBridgeError(f"NIXL transfer state {state}")

    _serve_sender(conn, side, one)
    agent.release_xfer_handle(handle)


# ---- Mooncake transfer engine (TCP) ---------------------------------------------------------
def mooncake_unusable() -> str | None:
    """Why Mooncake's transfer engine cannot run here (not installed, or a
    system library it links missing: its wheel needs Debian's libibverbs1
    even for TCP), or None."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name in ("mooncake", "mooncake.engine"):
            return "not installed (pip install mooncake-transfer-engine-non-cuda)"
        return f"cannot load ({e})"
    except (ImportError, OSError) as e:  # a shared library it links is missing
        return f"cannot load ({e}; its wheel needs Debian's libibverbs1)"
    return None


def mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise Unavailable("Mooncake TransferEngine.initialize failed")
    return te


def _mooncake_receiver(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    side = _Side(conn, scen, 1)
    te = mooncake_engine()
    if te.register_memory(side.buf.ctypes.data, side.buf.nbytes) != 0:
        raise Unavailable("Mooncake register_memory failed")
    conn.send(("info", (f"127.0.0.1:{te.get_rpc_port()}", side.buf.ctypes.data)))
    conn.send(("ready",))
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        if cmd[0] == "arm":
            side.zero()
            conn.send(("armed",))
        elif cmd[0] == "check":  # the sender's writes are synchronous: they landed
            conn.send(("digest", side.digest()))


MOONCAKE_BATCH = 1024  # its TCP transport rejects larger batches by default


def _mooncake_sender(conn: Any, scen: Scenario, opts: dict[str, Any]) -> None:
    side = _Side(conn, scen, 0)
    te = mooncake_engine()
    if te.register_memory(side.buf.ctypes.data, side.buf.nbytes) != 0:
        raise Unavailable("Mooncake register_memory failed")
    conn.send(("info", None))
    target, dst_base = conn.recv()[1]
    doff, _ = scen.pieces(scen.dst_bt)
    src = (side.off + side.buf.ctypes.data).tolist()
    dst = (doff + dst_base).tolist()
    lens = side.length.tolist()

    def one() -> None:
        for i in range(0, len(lens), MOONCAKE_BATCH):
            j = i + MOONCAKE_BATCH
            if te.batch_transfer_sync_write(target, src[i:j], dst[i:j], lens[i:j]) != 0:
                raise KVBridgeError("Mooncake batch_transfer_sync_write failed")

    _serve_sender(conn, side, one)


_SIDES = {
    "kvbridge": (_kvb_sender, _kvb_receiver),
    "ucxx": (_ucxx_sender, _ucxx_receiver),
    "nixl": (_nixl_sender, _nixl_receiver),
    "mooncake": (_mooncake_sender, _mooncake_receiver),
}
