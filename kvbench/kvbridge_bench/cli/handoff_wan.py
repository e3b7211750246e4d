"""The 100-token handoff over the real stack: kvbridge's TCP transport through
the packet-level WAN emulator (network namespaces; the kernel's TCP sees the
real round trip and loss).

Two processes: the main decode in namespace B, the relay in namespace A.
Per run, the relay hands 100 generated tokens to the main decode either as
their incremental KV (a Llama-3-8B-shaped transfer into the main decode's
pages, then one decode step) or as one TOKENS message with the commit (the
main decode extends the 100 tokens in one pass on the reference decoder and
answers ACK(switched)).  Latency is measured at the relay, from the start of
the handoff to the main decode's confirmation.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

N_TOKENS = 100
KV_READY = 0x80  # bench-private CONTROL types (0x80-0xFF are unassigned)
KV_DONE = 0x81


def _layout() -> Any:
    from kvbridge.layout import KVLayout

    return KVLayout.for_model("llama-3-8b", page_tokens=16)


async def main_side(host: str, runs: int) -> None:
    """Namespace B: the main decode."""
    import torch

    from kvbridge.handoff.messages import Ack, Tokens, decode, encode
    from kvbridge.pack import PagedKVCache
    from kvbridge.transport.tcp.kvio import KVSink
    from kvbridge.transport.tcp.receiver import TcpReceiver

    from ..reference.decoder import DecoderConfig, ReferenceDecoder

    torch.set_num_threads(1)
    lay = _layout()
    cache = PagedKVCache.allocate(lay, lay.pages_for(N_TOKENS))
    table = np.arange(lay.pages_for(N_TOKENS), dtype=np.int32)
    cfg = DecoderConfig()
    dec = ReferenceDecoder(cfg, cfg.kv_layout(), 64)
    rx = await TcpReceiver(host, 0, identity="main", compat_hash=lay.compat_hash).start()
    handles = [rx.expect(f"kv-{i}", KVSink(cache, table, 0, N_TOKENS, None)) for i in range(runs)]
    rid = [0]

    def on_tokens(conn: Any, ftype: int, payload: bytes) -> None:
        msg = decode(payload, ftype)
        assert isinstance(msg, Tokens)
        rid[0] += 1
        dec.allocate(rid[0])
        dec.prefill({rid[0]: list(range(1, 17))})
        dec.extend(rid[0], [int(t) % cfg.vocab_size for t in msg.tokens])
        dec.free(rid[0])
        conn.send_control(0x42, encode(Ack(msg.request_id, msg.end, True, msg.end)))

    def on_kv(h: Any, i: int) -> None:
        def done(_f: Any) -> None:
            dec.allocate(10_000 + i)
            dec.prefill({10_000 + i: [1]})
            dec.decode({10_000 + i: 2})  # the one decode step after the KV landed
            dec.free(10_000 + i)
            rx.send_control("relay", KV_DONE, i.to_bytes(4, "little"))

        asyncio.ensure_future(h.wait()).add_done_callback(done)

    rx.on_control(0x41, on_tokens)
    for i, h in enumerate(handles):
        on_kv(h, i)
    tokens = b"".join(h.token for h in handles)
    print(json.dumps({"port": rx.port, "tokens": tokens.hex()}), flush=True)
    await asyncio.sleep(3600)


async def relay_side(host: str, port: int, tokens: bytes, runs: int, warmup: int) -> dict[str, Any]:
    """Namespace A: the relay decode; times both kinds of handoff."""
    from kvbridge.handoff.messages import Tokens, decode, encode
    from kvbridge.handoff.params import SamplingParams
    from kvbridge.pack import PagedKVCache
    from kvbridge.transport.tcp.kvio import KVSource
    from kvbridge.transport.tcp.sender import TcpSender

    lay = _layout()
    src = PagedKVCache.allocate(lay, lay.pages_for(N_TOKENS), fill="random", seed=1)
    table = np.arange(lay.pages_for(N_TOKENS), dtype=np.int32)
    tx = TcpSender(
        host, port, identity="relay", compat_hash=lay.compat_hash, streams=4,
        chunk_size=1 << 20, compression="off",
    )  # fmt: skip
    await tx.connect()
    loop = asyncio.get_running_loop()
    waiters: dict[Any, asyncio.Future[None]] = {}

    def wake(key: Any) -> None:
        fut = waiters.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    tx.on_control(KV_DONE, lambda c, t, p: wake(("kv", int.from_bytes(p, "little"))))
    tx.on_control(0x42, lambda c, t, p: wake(("ids", decode(p, t).request_id)))
    kv_t, id_t, id_bytes = [], [], 0
    for i in range(runs):
        fut = waiters[("kv", i)] = loop.create_future()
        t0 = time.perf_counter()
        tok = tokens[16 * i : 16 * (i + 1)]
        await tx.send(f"kv-{i}", KVSource(src, table, 0, N_TOKENS, None), token=tok).wait(60)
        await asyncio.wait_for(fut, 60)
        kv_t.append(time.perf_counter() - t0)
        fut = waiters[("ids", i + 1)] = loop.create_future()
        t0 = time.perf_counter()
        msg = Tokens(i + 1, 1, tuple(range(1000, 1000 + N_TOKENS)), SamplingParams(), commit=True)
        payload = encode(msg)
        id_bytes = len(payload)
        tx.send_control(msg.KIND, payload)
        await asyncio.wait_for(fut, 60)
        id_t.append(time.perf_counter() - t0)
    await tx.close()

    def st(xs: list[float]) -> dict[str, float]:
        ms = [x * 1e3 for x in xs[warmup:]]
        return {
            "mean_ms": statistics.fmean(ms),
            "max_ms": max(ms),
            "std_ms": statistics.pstdev(ms),
            "runs": len(ms),
        }

    return {
        "incremental_kv": {**st(kv_t), "payload_bytes": lay.wire_nbytes(N_TOKENS)},
        "token_ids": {**st(id_t), "payload_bytes": id_bytes},
    }


def measure(
    rate_bps: float, rtt_ms: float, loss: float, runs: int, warmup: int = 2
) -> dict[str, Any]:
    """Start the emulator and both sides; returns the relay's figures."""
    from ..sim.emulator import WanEmulator

    py = sys.executable
    total = runs + warmup
    with WanEmulator(rate_bps=rate_bps, rtt_ms=rtt_ms, loss=loss) as emu:
        host = emu.addr("b")
        md = emu.popen(
            "b", [py, "-m", "kvbridge_bench.cli.handoff_wan", "main", host, str(total)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            info = json.loads(md.stdout.readline())  # type: ignore[union-attr]
            out = emu.run(
                "a",
                [py, "-m", "kvbridge_bench.cli.handoff_wan", "relay", host, str(info["port"]),
                 info["tokens"], str(total), str(warmup)],
                timeout=600, capture_output=True, text=True, check=True,
            )  # fmt: skip
            res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            md.terminate()
            md.wait(10)
    res["wan"] = {"rate_bps": rate_bps, "rtt_ms": rtt_ms, "loss": loss}
    return res


def _child(argv: list[str]) -> int:
    from kvbridge.transport.tcp import run

    if argv[0] == "main":
        run(main_side(argv[1], int(argv[2])))
        return 0
    res = run(relay_side(argv[1], int(argv[2]), bytes.fromhex(argv[3]), int(argv[4]), int(argv[5])))
    print(json.dumps(res), flush=True)
    return 0


def report(res: dict[str, Any]) -> str:
    w = res["wan"]
    lines = [
        f"over the real TCP transport through the packet-level emulator "
        f"({w['rate_bps'] / 1e9:g} Gbit/s, RTT {w['rtt_ms']:g} ms, loss {w['loss'] * 100:g}%)",
        f"  {'method':<16}{'payload':>12}{'mean ms':>10}{'max ms':>10}{'std ms':>10}{'runs':>6}",
    ]
    for name, key in (("incremental KV", "incremental_kv"), ("token IDs", "token_ids")):
        r = res[key]
        lines.append(
            f"  {name:<16}{r['payload_bytes']:>10} B{r['mean_ms']:10.1f}{r['max_ms']:10.1f}"
            f"{r['std_ms']:10.1f}{r['runs']:6d}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
