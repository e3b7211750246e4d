"""Process bodies of ``kvbridge-bench transfer``'s TCP comparison: kvbridge's
TCP transport, raw uvloop sockets and Mooncake's transfer engine (its TCP
transport) move the anchors' workload (``kvbridge_bench.cli.compare_peers.Scenario``:
256 MiB in one contiguous run, or 4096 pages of 64 KiB into a shuffled
destination) between two processes, one receiver and one sender per run.

* kvbridge: the bulk run as plain bytes (``BytesSource`` lends them, the
  receiver reads them from the socket straight into the destination); the
  pages through ``KVSource`` / ``KVSink`` (packed into chunks from the
  source's block table, unpacked into the destination's).  Completion: the
  receiver's COMPLETE (every byte written and checked).
* raw uvloop: the scenario's bytes as one contiguous buffer over the same
  number of connections, into one buffer (no framing, no checks, no
  integrity hash); completion: the receiver's one-byte answer per
  connection once every byte arrived.
* Mooncake: ``kvbridge_bench.cli.compare_peers``'s setup (its Python quick start:
  P2P handshake, ``tcp``); ``batch_transfer_sync_write`` returns once its
  TCP transport wrote the bytes to its sockets.

Each side of kvbridge and Mooncake hashes the bytes it moved (the sender
its source pieces, the receiver its destination pieces), so a run that
moved wrong bytes shows.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import (
    KVBridgeError,
    KVBridgeTimeout,
    PeerGone,
    RemoteProtocolError,
    Unavailable,
)
from kvbridge.layout import DType

from . import compare_peers
from .compare_peers import MOONCAKE_BATCH, Scenario, kvb_cache_view, pieces_digest, scenario_buffer

__all__ = ["Row", "rows_for", "run_one"]

LIBS = ("kvbridge", "kvbridge-pack", "kvbridge-2pass", "raw", "mooncake")


@dataclass
class Row:
    """One library set up one way."""

    name: str
    lib: str
    opts: dict[str, Any]
    setting: str
    times: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)  # each round's median time
    errors: list[str] = field(default_factory=list)
    corrupt: int = 0
    checked: bool = False  # whether its runs hashed the bytes at both ends


def rows_for(libs: list[str], streams: int) -> list[Row]:
    out = []
    if "kvbridge" in libs:
        out.append(
            Row(
                "kvbridge TCP",
                "kvbridge",
                {"streams": streams},
                f"{streams} streams, chunks fitted (4 MiB), compression off, checksums on",
            )
        )
    if "kvbridge-pack" in libs:
        out.append(
            Row(
                "kvb packed",
                "kvbridge",
                {"streams": streams, "zero_copy": False},
                "as kvbridge TCP, but the sender packs each KV chunk (checksum in the pack's "
                "copy) instead of writing the pages themselves (an experiment row, pages only)",
            )
        )
    if "kvbridge-2pass" in libs:
        out.append(
            Row(
                "kvb 2-pass",
                "kvbridge",
                {"streams": streams, "one_pass": False},
                "as kvbridge TCP, but each side hashes a KV chunk in a pass of its own "
                "(not in the pack / unpack copy; an experiment row, pages only)",
            )
        )
    if "raw" in libs:
        out.append(
            Row(
                "raw uvloop",
                "raw",
                {"streams": streams},
                f"{streams} streams, the same bytes as one buffer, no framing or checks",
            )
        )
    if "mooncake" in libs:
        out.append(
            Row(
                "Mooncake TE",
                "mooncake",
                {},
                "TCP transport, P2P handshake, its defaults, batches of 1024",
            )
        )
    return out


# ---- kvbridge TCP -----------------------------------------------------------------------
def kv_ends(
    scen: Scenario,
    buf: np.ndarray,
    bt: np.ndarray,
    sink: bool,
    one_pass: bool = True,
    zero_copy: bool = True,
) -> Any:
    """The kvbridge source or sink of ``scen`` over ``buf`` (``one_pass=False``:
    a KV end without its checksum in the copy, so that the transport packs
    each chunk and hashes it in a pass of its own; ``zero_copy=False``: a
    source that packs each chunk, its checksum in the pack's copy, instead
    of lending its pages)."""
    from kvbridge.pack import PagedKVCache
    from kvbridge.transport.tcp import BytesSource, KVSink, KVSource

    from .transfer_bench import _ReuseSink

    if scen.bulk:
        off, length = scen.pieces(bt)
        mv = buf.data[int(off[0]) : int(off[0]) + int(length[0])]
        return _ReuseSink(mv, len(mv)) if sink else BytesSource(mv)
    lay = scen.layout
    dt = {DType.FP16: np.float16, DType.FP32: np.float32}.get(
        lay.dtype, kvb_cache_view(buf, scen).dtype
    )
    cache = PagedKVCache(lay, buf.view(dt).reshape(lay.cache_shape(scen.num_pages)))
    end = (
        KVSink(cache, bt, scen.start, scen.end, None)
        if sink
        else KVSource(cache, bt, scen.start, scen.end, None, zero_copy=zero_copy and one_pass)
    )
    if not one_pass:
        for name in ("read_checksummed", "write_checksummed"):
            if name in vars(end):
                delattr(end, name)
    return end


def _kvb_receiver(conn: Any, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    from kvbridge.transport.tcp import TcpReceiver, run

    async def main() -> None:
        buf = scenario_buffer(scen, fill=False)
        rx = await TcpReceiver("127.0.0.1", 0, compat_hash=scen.layout.compat_hash).start()
        hs = [
            rx.expect(
                f"it{i}",
                kv_ends(scen, buf, scen.dst_bt, True, opts.get("one_pass", True)),
                timeout=600,
            )
            for i in range(iters + 1)
        ]
        conn.send(("ready", (rx.port, [h.token for h in hs])))
        for h in hs:
            await h
        await asyncio.get_running_loop().run_in_executor(None, _finish_receiver, conn, buf, scen)
        await rx.close()

    run(main())


def _kvb_sender(
    buf: np.ndarray, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> list[float]:
    from kvbridge.transport.tcp import TcpSender, run

    port, tokens = info

    async def main() -> list[float]:
        tx = TcpSender(
            "127.0.0.1",
            port,
            streams=int(opts.get("streams", 4)),
            compat_hash=scen.layout.compat_hash,
            compression="off",
        )
        await tx.connect()
        times = []
        for i in range(iters + 1):
            src = kv_ends(
                scen,
                buf,
                scen.src_bt,
                False,
                opts.get("one_pass", True),
                opts.get("zero_copy", True),
            )
            t = time.perf_counter()
            await tx.send(f"it{i}", src, token=tokens[i], timeout=600).wait(600)
            times.append(time.perf_counter() - t)
        await tx.close()
        return times

    return run(main())


# ---- raw uvloop: the same bytes, contiguous, over the same number of connections -----------
def _raw_receiver(conn: Any, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    from kvbridge.transport.tcp import run

    from .transfer_bench import _RawRx

    class Server:  # what _RawRx asks of its server: where the bytes go (one buffer)
        def __init__(self) -> None:
            self.buf = bytearray(scen.nbytes)

        def raw_buf(self, n: int) -> memoryview:
            return memoryview(self.buf)[:n]

    async def main() -> None:
        srv = Server()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _RawRx(srv), "127.0.0.1", 0)  # type: ignore[arg-type]
        conn.send(("ready", server.sockets[0].getsockname()[1]))
        msg = await loop.run_in_executor(None, conn.recv)
        assert msg[0] == "digest"
        conn.send(("digest", None))  # the baseline checks nothing
        server.close()

    run(main())


def _raw_sender(
    buf: np.ndarray, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> list[float]:
    from kvbridge.transport.tcp import run

    from .transfer_bench import _raw_run

    off, length = scen.pieces(scen.src_bt)
    flat = np.concatenate(
        [buf[o : o + n] for o, n in zip(off.tolist(), length.tolist(), strict=True)]
    )

    async def main() -> list[float]:
        conns: list[Any] = []
        times = []
        for _ in range(iters + 1):
            times.append(await _raw_run("127.0.0.1", info, flat.data, int(opts["streams"]), conns))
        for _, w in conns:
            w.close()
        return times

    return run(main())


# ---- Mooncake's transfer engine (TCP): compare_peers' setup, one run per process pair ----------
def _mooncake_receiver(conn: Any, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    buf = scenario_buffer(scen, fill=False)
    te = compare_peers.mooncake_engine()
    if te.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise Unavailable("Mooncake register_memory failed")
    conn.send(("ready", (f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data)))
    _finish_receiver(conn, buf, scen)  # its writes are synchronous: they landed


def _mooncake_sender(
    buf: np.ndarray, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> list[float]:
    target, dst_base = info
    soff, length = scen.pieces(scen.src_bt)
    doff, _ = scen.pieces(scen.dst_bt)
    te = compare_peers.mooncake_engine()
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


# ---- one run ----------------------------------------------------------------------------------
def _finish_receiver(conn: Any, buf: np.ndarray, scen: Scenario) -> None:
    """Answer the parent's ``("digest",)`` with the destination pieces' digest."""
    msg = conn.recv()
    if msg[0] != "digest":
        raise RemoteProtocolError(f"expected ('digest',), got {msg[0]!r}")
    off, length = scen.pieces(scen.dst_bt)
    conn.send(("digest", pieces_digest(buf, off, length)))


_RECEIVERS = {"kvbridge": _kvb_receiver, "raw": _raw_receiver, "mooncake": _mooncake_receiver}
_SENDERS = {"kvbridge": _kvb_sender, "raw": _raw_sender, "mooncake": _mooncake_sender}


QUIET = {"GLOG_minloglevel": "2"}  # Mooncake's glog: warnings and errors only


def receiver_main(conn: Any, lib: str, scen: Scenario, iters: int, opts: dict[str, Any]) -> None:
    os.environ.update(QUIET)
    try:
        _RECEIVERS[lib](conn, scen, iters, opts)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def sender_main(
    conn: Any, lib: str, scen: Scenario, iters: int, info: Any, opts: dict[str, Any]
) -> None:
    os.environ.update(QUIET)
    try:
        buf = scenario_buffer(scen, fill=True)
        times = _SENDERS[lib](buf, scen, iters, info, opts)
        off, length = scen.pieces(scen.src_bt)
        conn.send(("times", times, pieces_digest(buf, off, length)))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _get(conn: Any, timeout: float, proc: Any) -> Any:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0.2):
            raise PeerGone(f"{proc.name} exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise KVBridgeTimeout(f"no answer within {timeout} s")
    return conn.recv()


def run_one(row: Row, scen: Scenario, iters: int, timeout: float) -> dict[str, Any]:
    """One receiver and one sender process; the sender's times (the first,
    warm-up, dropped) and whether the bytes arrived intact."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rconn, rchild = ctx.Pipe()
    sconn, schild = ctx.Pipe()
    recv = ctx.Process(
        target=receiver_main,
        args=(rchild, row.lib, scen, iters, row.opts),
        daemon=True,
        name=f"{row.name} receiver",
    )
    recv.start()
    send = None
    try:
        msg = _get(rconn, timeout, recv)
        if msg[0] != "ready":
            return {"error": msg[1]}
        send = ctx.Process(
            target=sender_main,
            args=(schild, row.lib, scen, iters, msg[1], row.opts),
            daemon=True,
            name=f"{row.name} sender",
        )
        send.start()
        res = _get(sconn, timeout, send)
        if res[0] != "times":
            return {"error": res[1]}
        rconn.send(("digest",))
        dig = _get(rconn, timeout, recv)
        if dig[0] != "digest":
            return {"error": dig[1]}
        return {"times": res[1][1:], "ok": None if dig[1] is None else dig[1] == res[2]}
    except KVBridgeError as e:
        return {"error": str(e)}
    finally:
        for p in (send, recv):
            if p is not None:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
        for c in (rconn, sconn, rchild, schild):
            c.close()
