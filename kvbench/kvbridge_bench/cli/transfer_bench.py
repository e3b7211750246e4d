"""Transfer benchmarks: kvbridge against raw uvloop sockets, and the latency
of small transfers behind a large one.  Used by ``kvbridge-bench transfer``
and bench/bench_transfer.py.

The receiving side is a *bench server* (:func:`serve`): a kvbridge receiver
plus a raw-socket receiver on a second port.  The sender asks it to expect a
transfer with a CONTROL frame (``EXPECT_REQ``: u64 size + request id) and gets
the token back (``EXPECT_TOKEN``), which is also a small demonstration of the
CONTROL API.  Raw baseline: per stream, a u64 length then the bytes, answered
by one byte once all arrived; the receiver reads straight into a
preallocated buffer (the best case for plain sockets).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvbridge.errors import InvalidArgument, KVBridgeError
from kvbridge.transport.tcp.conn import FrameConnection
from kvbridge.transport.tcp.kvio import BytesSource
from kvbridge.transport.tcp.receiver import TcpReceiver
from kvbridge.transport.tcp.sender import TcpSender

__all__ = ["BenchServer", "measure_goodput", "measure_latency", "serve", "spawn_server"]

EXPECT_REQ = 0x80
EXPECT_TOKEN = 0x81
_U64 = struct.Struct("<Q")


class _ReuseSink:
    """Writes every transfer into one reused buffer (like the raw baseline)."""

    layout_hash = 0
    token_range = (0, 0)
    layer_range = (0, 0)
    flush_on_loop = True

    def __init__(self, buf: bytearray | memoryview, nbytes: int) -> None:
        self.buf = memoryview(buf)
        self.nbytes = nbytes

    def write(self, offset: int, data: memoryview) -> None:
        self.buf[offset : offset + len(data)] = data

    def view(self, offset: int, n: int) -> memoryview:
        return self.buf[offset : offset + n]

    def flush(self) -> None:
        return None


class _RawRx(asyncio.BufferedProtocol):
    def __init__(self, server: BenchServer) -> None:
        self.server = server
        self.need = -1
        self.got = 0
        self.head = bytearray(8)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.need < 0:
            return memoryview(self.head)[self.got :]
        return self.server.raw_buf(self.need)[self.got : self.need]

    def buffer_updated(self, n: int) -> None:
        self.got += n
        if self.need < 0 and self.got == 8:
            (self.need,) = _U64.unpack(self.head)
            self.got = 0
        if self.need >= 0 and self.got == self.need:
            assert self.transport is not None
            self.transport.write(b"\x01")
            self.need, self.got = -1, 0


class BenchServer:
    def __init__(self, rx: TcpReceiver) -> None:
        self.rx = rx
        self._buf = bytearray()
        self._raw: dict[int, bytearray] = {}
        self.raw_server: asyncio.Server | None = None
        rx.on_control(EXPECT_REQ, self._on_expect)

    def _sink_buf(self, n: int) -> bytearray:
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return self._buf

    def raw_buf(self, n: int) -> memoryview:
        b = self._raw.get(n)
        if b is None:
            b = self._raw[n] = bytearray(n)
        return memoryview(b)

    def _on_expect(self, conn: FrameConnection, typ: int, payload: bytes) -> None:
        (n,) = _U64.unpack_from(payload)
        rid = payload[8:].decode()
        h = self.rx.expect(rid, _ReuseSink(self._sink_buf(n), n), timeout=600)
        conn.send_control(EXPECT_TOKEN, h.token + payload[8:])


async def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    raw_port: int = 0,
    *,
    ready: Callable[[dict[str, Any]], None] | None = None,
    **rx_kwargs: Any,
) -> None:
    """Run a bench server until cancelled."""
    rx = await TcpReceiver(host, port, **rx_kwargs).start()
    srv = BenchServer(rx)
    loop = asyncio.get_running_loop()
    srv.raw_server = await loop.create_server(lambda: _RawRx(srv), host, raw_port)
    info = {"host": host, "port": rx.port, "raw_port": srv.raw_server.sockets[0].getsockname()[1]}
    if ready is not None:
        ready(info)
    try:
        await asyncio.Event().wait()
    finally:
        srv.raw_server.close()
        await rx.close()


class _TokenBroker:
    """Asks the bench server to expect transfers; awaits the tokens."""

    def __init__(self, tx: TcpSender) -> None:
        self.tx = tx
        self.waiting: dict[str, asyncio.Future[bytes]] = {}
        tx.on_control(EXPECT_TOKEN, self._on_token)

    def _on_token(self, conn: FrameConnection, typ: int, payload: bytes) -> None:
        fut = self.waiting.pop(payload[16:].decode(), None)
        if fut is not None and not fut.done():
            fut.set_result(payload[:16])

    async def token(self, rid: str, nbytes: int) -> bytes:
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        self.tx.send_control(EXPECT_REQ, _U64.pack(nbytes) + rid.encode())
        return await asyncio.wait_for(fut, 30)


async def _raw_run(host: str, port: int, data: memoryview, streams: int, conns: list[Any]) -> float:
    """Move ``data`` over ``streams`` raw connections; returns seconds."""
    loop = asyncio.get_running_loop()
    if not conns:
        for _ in range(streams):
            conns.append(await asyncio.open_connection(host, port))
    part = -(-len(data) // streams)
    t0 = time.perf_counter()
    for i, (_, w) in enumerate(conns):
        piece = data[i * part : (i + 1) * part]
        w.write(_U64.pack(len(piece)))
        w.write(piece)
    await asyncio.gather(*(w.drain() for _, w in conns))
    await asyncio.gather(*(r.readexactly(1) for r, _ in conns))
    _ = loop
    return time.perf_counter() - t0


async def measure_goodput(
    host: str,
    port: int,
    raw_port: int,
    *,
    nbytes: int = 256 << 20,
    streams: int = 4,
    chunk_size: int | None = None,
    repeats: int = 5,
    warmup: int = 1,
    compression: str = "auto",
    progress: Callable[[int], None] | None = None,
    data_kind: str = "random",
    **tx_kwargs: Any,
) -> dict[str, Any]:
    """Median goodput of kvbridge and of raw sockets moving the same bytes
    over the same number of connections, interleaved run by run; the ratio
    is the median (and range) of the rounds' ratios.  ``data_kind``: "random" bytes, or "kv": the
    reference decoder's real bf16 KV (a 4 MiB sample repeated: farther apart
    than the zstd-1 and lz4 windows reach, so each chunk compresses as unique
    KV would)."""
    itemsize = 1
    if data_kind == "kv":
        sample = reference_kv(4 << 20, wide=True)
        data = memoryview((sample * (nbytes // len(sample) + 1))[:nbytes])
        itemsize = 2
    elif data_kind == "random":
        data = memoryview(os.urandom(nbytes))
    else:
        raise InvalidArgument(f"data_kind must be 'random' or 'kv', not {data_kind!r}")
    tx = TcpSender(
        host, port, streams=streams, chunk_size=chunk_size, compression=compression, **tx_kwargs
    )
    await tx.connect()
    broker = _TokenBroker(tx)
    raw_conns: list[Any] = []
    kvb: list[float] = []
    raw: list[float] = []
    last: Any = None
    try:
        for i in range(warmup + repeats):
            rid = f"goodput-{i}"
            token = await broker.token(rid, nbytes)
            t0 = time.perf_counter()
            last = await tx.send(rid, BytesSource(data, itemsize=itemsize), token=token).wait(600)
            tk = time.perf_counter() - t0
            tr = await _raw_run(host, raw_port, data, streams, raw_conns)
            if i >= warmup:
                kvb.append(nbytes / tk)
                raw.append(nbytes / tr)
            if progress is not None:
                progress(i)
    finally:
        for _, w in raw_conns:
            w.close()
        await tx.close()
    k, r = statistics.median(kvb), statistics.median(raw)
    ratios = [a / b for a, b in zip(kvb, raw, strict=True)]  # round by round
    return {
        "bytes": nbytes,
        "streams": streams,
        "kvbridge_bytes": nbytes,
        "kvbridge_streams": last.streams if last is not None else streams,
        "raw_bytes": nbytes,
        "raw_streams": len(raw_conns),
        "chunk_size": last.chunk_size if last is not None else chunk_size,
        "chunk_auto": chunk_size is None,
        "repeats": repeats,
        "kvbridge_GBps": k / 1e9,
        "raw_GBps": r / 1e9,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratios": ratios,
        "compression": last.compression if last is not None else {},
    }


async def measure_latency(
    host: str,
    port: int,
    *,
    big_bytes: int = 2 << 30,
    small_bytes: int = 1 << 20,
    count: int = 50,
    rounds: int = 5,
    interval: float = 0.02,
    streams: int = 4,
    chunk_size: int | None = None,
    policies: tuple[str, ...] = ("srpt", "fifo"),
    progress: Callable[[int], None] | None = None,
    **tx_kwargs: Any,
) -> dict[str, Any]:
    """Completion times of small transfers started while a large one runs,
    for each scheduler policy, in interleaved rounds (one sender per policy;
    each round takes ``count / rounds`` samples of each policy in turn).  A
    sample counts only if the large transfer was running when the small one
    started and when it completed; a large transfer that finishes is
    replaced by the next, so every policy gets ``count`` samples.  Returns
    per policy P50 / P99 and the sample count, and the fifo / srpt ratios
    (median and range over the rounds)."""
    per_round = -(-count // rounds)
    senders: dict[str, TcpSender] = {}
    brokers: dict[str, _TokenBroker] = {}
    for policy in policies:
        tx = TcpSender(
            host, port, streams=streams, chunk_size=chunk_size, scheduler=policy,
            compression="off", **tx_kwargs,
        )  # fmt: skip
        await tx.connect()
        senders[policy], brokers[policy] = tx, _TokenBroker(tx)
    big = memoryview(bytearray(big_bytes))
    small = memoryview(os.urandom(small_bytes))
    lat: dict[str, list[float]] = {p: [] for p in policies}
    by_round: dict[str, list[list[float]]] = {p: [] for p in policies}
    bigs = dict.fromkeys(policies, 0)
    done = 0
    try:
        for r in range(rounds):
            for policy in policies:
                tx, broker = senders[policy], brokers[policy]
                got: list[float] = []
                hb = None
                i = 0
                while len(got) < min(per_round, count - len(lat[policy])):
                    if hb is None or hb.done():  # (another) large transfer to hide behind
                        rid = f"big-{policy}-{r}-{bigs[policy]}"
                        tok = await broker.token(rid, big_bytes)
                        hb = tx.send(rid, BytesSource(big), token=tok, timeout=600)
                        bigs[policy] += 1
                        while hb.acked_bytes < min(big_bytes // 10, 64 << 20) and not hb.done():
                            await asyncio.sleep(0.001)
                        continue
                    rid = f"small-{policy}-{r}-{i}"
                    i += 1
                    tok = await broker.token(rid, small_bytes)
                    if hb.done():
                        continue
                    t0 = time.perf_counter()
                    await tx.send(rid, BytesSource(small), token=tok).wait(600)
                    dt = time.perf_counter() - t0
                    if not hb.done():  # behind the large one the whole time
                        got.append(dt)
                        done += 1
                        if progress is not None:
                            progress(done)
                    await asyncio.sleep(interval)
                if hb is not None:
                    hb.cancel()
                lat[policy] += got
                by_round[policy].append(got)
    finally:
        for tx in senders.values():
            await tx.close()

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")

    out: dict[str, Any] = {
        "big_bytes": big_bytes,
        "small_bytes": small_bytes,
        "streams": streams,
        "rounds": rounds,
        "policies": [
            {
                "scheduler": p,
                "samples": len(lat[p]),
                "big_transfers": bigs[p],
                "p50_ms": pct(lat[p], 0.50),
                "p99_ms": pct(lat[p], 0.99),
            }
            for p in policies
        ],
    }
    if "srpt" in policies and "fifo" in policies:
        for q, key in ((0.5, "p50"), (0.99, "p99")):
            rs = [
                pct(f, q) / pct(s, q)
                for s, f in zip(by_round["srpt"], by_round["fifo"], strict=True)
                if s and f
            ]
            if rs:
                out[f"fifo_over_srpt_{key}"] = statistics.median(rs)
                out[f"fifo_over_srpt_{key}_range"] = (min(rs), max(rs))
    return out


def spawn_server(extra: list[str] | None = None) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start ``kvbridge-bench transfer serve`` in a child process; returns it
    and its ports."""
    cmd = [sys.executable, "-m", "kvbridge_bench.cli.transfer", "serve", "--port", "0"]
    proc = subprocess.Popen(cmd + (extra or []), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise KVBridgeError("bench server did not start")
    return proc, json.loads(line)


def synthetic_kv(nbytes: int, head_dim: int = 128, seed: int = 0) -> bytes:
    """fp16 KV-like bytes: normal values with a log-normal scale per channel
    (KV caches have outlier channels).  Synthetic: say so when reporting."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = nbytes // 2
    scale = rng.lognormal(0.0, 1.0, head_dim).astype(np.float32)
    rows = -(-n // head_dim)
    vals = rng.standard_normal((rows, head_dim), dtype=np.float32) * scale
    return vals.astype(np.float16).tobytes()[: n * 2]


def reference_kv(
    nbytes: int = 4 << 20, dtype: str = "bf16", seed: int = 0, *, wide: bool = False
) -> bytes:
    """Real KV bytes: the reference decoder's cache after prefilling a random
    prompt (4 layers, 2 KV heads of 32; ``wide``: 8 KV heads of 64, for large
    samples), packed into the wire layout."""
    import torch

    from kvbridge.pack import PagedKVCache, pack

    from ..reference.decoder import DecoderConfig, ReferenceDecoder

    cfg = DecoderConfig(seed=seed)
    if wide:
        cfg = DecoderConfig(
            hidden_size=512, num_heads=8, num_kv_heads=8, head_dim=64, intermediate_size=1024,
            seed=seed,
        )  # fmt: skip
    lay = cfg.kv_layout(dtype=dtype, page_tokens=16)
    n = max(16, nbytes // lay.bytes_per_token)
    dec = ReferenceDecoder(cfg, lay, lay.pages_for(n))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    dec.allocate(1)
    dec.prefill({1: prompt[:512]})
    for i in range(512, n, 512):  # chunked prefill keeps the attention small
        dec.extend(1, prompt[i : i + 512])
    cache = PagedKVCache(lay, dec.kv_cache)
    return bytes(pack(cache, dec.block_table(1), 0, n))[:nbytes]


def compression_report(
    data: bytes | memoryview,
    itemsize: int = 2,
    link_gbits: tuple[float, ...] = (1.0, 10.0, 40.0, 100.0),
    spare_cores: int | None = None,
) -> dict[str, Any]:
    """Shuffle + lz4 / zstd-1 ratios of one 4 MiB sample and the adaptive
    decision at several link rates."""
    from kvbridge.transport.tcp.compress import CompressionPolicy

    sample = memoryview(data)[: 4 << 20]
    out: dict[str, Any] = {"sample_bytes": len(sample), "decisions": []}
    for g in link_gbits:
        pol = CompressionPolicy("auto", link_Bps=g * 1e9 / 8, spare_cores=spare_cores)
        pol.best_compress_Bps = float("inf")  # always run the trial, to report the ratios
        d = pol.decide(sample, itemsize, 1 << 30)
        out["decisions"].append({"link_gbit": g, **d.as_dict()})
    return out
