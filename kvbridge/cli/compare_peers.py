"""Process bodies of ``kvbridge-bench compare``: one receiver and one sender
per library, started with multiprocessing spawn.  Every library moves the same
pieces (one per page, layer and K/V component) between the same two buffers;
kvbridge is given the block tables instead and coalesces them itself."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidArgument, KVBridgeError, Unavailable
from ..layout import KVLayout
from ..transport.tcp import run


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
        from ..transport.ucx.runs import CacheGeometry, page_pieces

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


def _buffer(scen: Scenario, fill: bool) -> np.ndarray:
    buf = np.zeros(scen.region_bytes, dtype=np.uint8)
    if fill:
        words = buf.view(np.uint64)
        words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return buf


def _digest(buf: np.ndarray, off: np.ndarray, length: np.ndarray) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    mv = memoryview(buf.data)
    for o, n in zip(off.tolist(), length.tolist(), strict=True):
        h.update(mv[o : o + n])
    return h.hexdigest()


def receiver_main(
    conn: Any, env: dict[str, str], lib: str, scen: Scenario, iters: int, opts: dict[str, Any]
) -> None:
    os.environ.update(env)
    try:
        _RECEIVERS[lib](conn, scen, iters, opts)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def sender_main(
    conn: Any,
    env: dict[str, str],
    lib: str,
    scen: Scenario,
    iters: int,
    info: Any,
    opts: dict[str, Any],
) -> None:
    os.environ.update(env)
    try:
        buf = _buffer(scen, fill=True)
        times = _SENDERS[lib](buf, scen, iters, info, opts)
        off, length = scen.pieces(scen.src_bt)
        conn.send(("times", times, _digest(buf, off, length)))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _finish_receiver(conn: Any, buf: np.ndarray, scen: Scenario) -> None:
    msg = conn.recv()
    assert msg[0] == "digest"
    off, length = scen.pieces(scen.dst_bt)
    conn.send(("digest", _digest(buf, off, length)))


# ---- kvbridge ------------------------------------------------------------------------
def _kvb_cache(buf: np.ndarray, scen: Scenario) -> np.ndarray:
    lay = scen.layout
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32}[lay.itemsize]
    return buf.view(dt).reshape(lay.cache_shape(scen.num_pages))


def _kvb_receiver(conn: Any, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    from ..transport.ucx import UcxAgent

    async def main() -> None:
        buf = _buffer(scen, fill=False)
        agent = UcxAgent(scen.layout, _kvb_cache(buf, scen), staging_bytes=0, timeout=300, **opts)
        handles = [
            agent.expect(f"it{i}", scen.dst_bt, scen.start, scen.end) for i in range(iters + 1)
        ]
        conn.send(("ready", agent.metadata()))
        for h in handles:
            await h
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _finish_receiver, conn, buf, scen)
        await agent.close()

    run(main())


def _kvb_sender(
    buf: np.ndarray, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> list[float]:
    from ..transport.ucx import UcxAgent

    async def main() -> list[float]:
        agent = UcxAgent(scen.layout, _kvb_cache(buf, scen), staging_bytes=0, timeout=300, **opts)
        peer = await agent.connect(info)
        times = []
        for i in range(iters + 1):
            t = time.perf_counter()
            await peer.send(f"it{i}", scen.src_bt, scen.dst_bt, scen.start, scen.end)
            times.append(time.perf_counter() - t)
        await agent.close()
        return times

    return run(main())


# ---- raw ucxx: one contiguous buffer of the same size -------------------------------
def _ucxx_receiver(conn: Any, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    import ucxx

    async def main() -> None:
        buf = np.zeros(scen.nbytes, dtype=np.uint8)
        done = asyncio.Event()
        errors: list[str] = []

        async def serve(ep: Any) -> None:
            try:
                for _ in range(iters + 1):
                    await ep.recv(buf)
                # the sender exits after this ack, not before the last bytes landed
                await ep.send(np.ones(1, dtype=np.uint8))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
            finally:
                done.set()

        listener = ucxx.create_listener(serve)
        conn.send(("ready", listener.port))
        await done.wait()
        listener.close()
        msg = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        assert msg[0] == "digest"
        if errors:
            conn.send(("error", errors[0]))
        else:
            conn.send(("digest", _digest(buf, np.zeros(1, dtype=np.int64), np.array([buf.size]))))

    run(main())


def _ucxx_sender(
    buf: np.ndarray, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> list[float]:
    import ucxx

    async def main() -> list[float]:
        ep = await ucxx.create_endpoint("127.0.0.1", info)
        off, length = scen.pieces(scen.src_bt)
        flat = np.concatenate(
            [buf[o : o + n] for o, n in zip(off.tolist(), length.tolist(), strict=True)]
        )
        times = []
        for _ in range(iters + 1):
            t = time.perf_counter()
            await ep.send(flat)
            times.append(time.perf_counter() - t)
        await ep.recv(np.empty(1, dtype=np.uint8))
        return times

    return run(main())


# ---- NIXL (UCX backend, DRAM descriptors) ----------------------------------------------
def _nixl_agent(name: str, opts: dict[str, Any]) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=opts.get("progress_thread", True), backends=[])
    agent = nixl_agent(name, cfg)
    agent.create_backend("UCX", dict(opts.get("params", {})))
    return agent


def _nixl_receiver(conn: Any, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    buf = _buffer(scen, fill=False)
    agent = _nixl_agent("kvb-target", opts)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send(("ready", (agent.get_agent_metadata(), buf.ctypes.data)))
    # Without a progress thread the target progresses while it waits for the
    # notifications (get_new_notifs), as NIXL's examples do; the sender posts
    # every transfer with one.
    got, deadline = 0, time.monotonic() + 600
    while got < iters + 1 and time.monotonic() < deadline:
        got += sum(len(v) for v in agent.get_new_notifs().values())
        if opts.get("progress_thread", True) and got < iters + 1:
            time.sleep(0.001)
    _finish_receiver(conn, buf, scen)


def _nixl_sender(
    buf: np.ndarray, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> list[float]:
    md, dst_base = info
    agent = _nixl_agent("kvb-initiator", opts)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(md)
    soff, length = scen.pieces(scen.src_bt)
    doff, _ = scen.pieces(scen.dst_bt)
    zeros = np.zeros_like(length)
    local = agent.get_xfer_descs(np.stack([soff + buf.ctypes.data, length, zeros], 1), "DRAM")
    rem = agent.get_xfer_descs(np.stack([doff + dst_base, length, zeros], 1), "DRAM")
    handle = agent.initialize_xfer("WRITE", local, rem, remote, b"kvb")
    times = []
    deadline = time.monotonic() + 600
    for _ in range(iters + 1):
        t = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise KVBridgeError(f"NIXL transfer state {state}")
        times.append(time.perf_counter() - t)
    agent.release_xfer_handle(handle)
    return times


# ---- Mooncake transfer engine (TCP) ---------------------------------------------------------
def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise Unavailable("Mooncake TransferEngine.initialize failed")
    return te


def _mooncake_receiver(conn: Any, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    buf = _buffer(scen, fill=False)
    te = _mooncake_engine()
    if te.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise Unavailable("Mooncake register_memory failed")
    conn.send(("ready", (f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data)))
    _finish_receiver(conn, buf, scen)


MOONCAKE_BATCH = 1024  # its TCP transport rejects larger batches by default


def _mooncake_sender(
    buf: np.ndarray, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> list[float]:
    target, dst_base = info
    soff, length = scen.pieces(scen.src_bt)
    doff, _ = scen.pieces(scen.dst_bt)
    te = _mooncake_engine()
    if te.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise Unavailable("Mooncake register_memory failed")
    src = (soff + buf.ctypes.data).tolist()
    dst = (doff + dst_base).tolist()
    lens = length.tolist()
    times = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        for i in range(0, len(lens), MOONCAKE_BATCH):
            j = i + MOONCAKE_BATCH
            if te.batch_transfer_sync_write(target, src[i:j], dst[i:j], lens[i:j]) != 0:
                raise KVBridgeError("Mooncake batch_transfer_sync_write failed")
        times.append(time.perf_counter() - t)
    return times


_RECEIVERS = {
    "kvbridge": _kvb_receiver,
    "ucxx": _ucxx_receiver,
    "nixl": _nixl_receiver,
    "mooncake": _mooncake_receiver,
}
_SENDERS = {
    "kvbridge": _kvb_sender,
    "ucxx": _ucxx_sender,
    "nixl": _nixl_sender,
    "mooncake": _mooncake_sender,
}
