"""The engine-facing bridge over TCP: dual-destination sends between different
layouts, layer-wise sends, tickets, cancellation, bad input, peer death."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge, Ticket, TicketTransport
from kvbridge.errors import (
    Cancelled,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    PeerGone,
    RemoteProtocolError,
    TransferAborted,
    TransferTimeout,
    Unavailable,
    VersionMismatch,
)
from kvbridge.layout import KVLayout

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)
MD = P.replace(page_tokens=64, order="page_first", head_order="HND")
RLD = P.replace(page_tokens=32)


def _table(n_pages: int, layout: KVLayout, end: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(n_pages)[: layout.pages_for(end)].astype(np.int32)


def _same(
    a: pack.PagedKVCache,
    at: np.ndarray,
    b: pack.PagedKVCache,
    bt: np.ndarray,
    s: int,
    e: int,
    layers: tuple[int, int] | None = None,
) -> bool:
    x = pack.pack(a, at, s, e, layers=layers)
    y = pack.pack(b, bt, s, e, layers=layers)
    return bytes(np.asarray(x)) == bytes(np.asarray(y))


async def _pair(
    **md_kw: object,
) -> tuple[
    PrefillBridge,
    DecodeBridge,
    DecodeBridge,
    pack.PagedKVCache,
    pack.PagedKVCache,
    pack.PagedKVCache,
]:
    src = pack.PagedKVCache.allocate(P, 96, fill="random", seed=1)
    md_cache = pack.PagedKVCache.allocate(MD, 24)
    rld_cache = pack.PagedKVCache.allocate(RLD, 48)
    md = await DecodeBridge(md_cache, identity="md", tcp_listen=("127.0.0.1", 0), **md_kw).start()
    rld = await DecodeBridge(rld_cache, identity="rld", tcp_listen=("127.0.0.1", 0)).start()
    pre = PrefillBridge(src, identity="p")
    await pre.connect("md", PeerConfig("tcp", *md.tcp_address, streams=3, chunk_size=32 << 10))
    await pre.connect("rld", PeerConfig("tcp", *rld.tcp_address, streams=1, compression="off"))
    return pre, md, rld, src, md_cache, rld_cache


async def _close(*objs: object) -> None:
    for o in objs:
        await o.close()  # type: ignore[attr-defined]


def run_pair(body: object, timeout: float = 30.0) -> None:
    """Run ``body(pre, md, rld, src, md_cache, rld_cache)`` on a fresh bridge
    trio, closing it whatever happens."""

    async def main() -> None:
        trio = await _pair()
        try:
            await body(*trio)  # type: ignore[operator]
        finally:
            await _close(*trio[:3])

    arun(main(), timeout)


def test_dual_send_lands_in_both_layouts() -> None:
    """One send feeds two destinations with their own layouts and ranges: the
    relay gets the whole prompt, the main decode only the suffix it lacks."""

    async def main(pre, md, rld, src, mdc, rldc) -> None:  # type: ignore[no-untyped-def]
        n, matched = 1000, 320
        st, mt, rt = _table(96, P, n, 1), _table(24, MD, n, 2), _table(48, RLD, n, 3)
        e_md = md.expect(7, mt, matched, n)
        e_rld = rld.expect(7, rt, 0, n)
        ms = pre.send(7, st, {"md": e_md.ticket, "rld": e_rld.ticket})
        out = await ms.wait(30)
        assert (await e_md.wait(30)).bytes == P.wire_nbytes(n - matched)
        assert (await e_rld.wait(30)).bytes == P.wire_nbytes(n)
        assert out["md"].bytes == P.wire_nbytes(n - matched) and out["md"].path == "tcp"
        assert out["rld"].bytes == P.wire_nbytes(n)
        assert _same(src, st, mdc, mt, matched, n)
        assert _same(src, st, rldc, rt, 0, n)
        # the main decode's prefix pages were not touched
        assert not np.asarray(pack.pack(mdc, mt, 0, matched)).any()

    run_pair(main)


def test_each_destination_completes_on_its_own() -> None:
    """A destination that fails does not hold back the other one."""

    async def main(pre, md, rld, src, mdc, rldc) -> None:  # type: ignore[no-untyped-def]
        n = 600
        st, mt, rt = _table(96, P, n, 4), _table(24, MD, n, 5), _table(48, RLD, n, 6)
        e_md = md.expect("r", mt, 0, n)
        e_rld = rld.expect("r", rt, 0, n)
        e_md.cancel("the main decode dropped the request")
        ms = pre.send("r", st, {"md": e_md.ticket, "rld": e_rld.ticket})
        res = await ms.wait_all(30)
        assert isinstance(res["md"], KVBridgeError)
        assert not isinstance(res["rld"], KVBridgeError) and res["rld"].bytes == P.wire_nbytes(n)
        assert _same(src, st, rldc, rt, 0, n)
        with pytest.raises(KVBridgeError):
            await ms.wait(5)

    run_pair(main)


def test_layerwise_send_releases_layers_as_prefill_computes_them() -> None:
    async def main(pre, md, rld, src, mdc, rldc) -> None:  # type: ignore[no-untyped-def]
        n = 700
        st, mt = _table(96, P, n, 7), _table(24, MD, n, 8)
        e_md = md.expect(9, mt, 0, n)
        lw = pre.send_layerwise(9, st, {"md": e_md.ticket})
        await asyncio.sleep(0.2)
        assert not e_md.done()  # nothing may complete before the layers exist
        for layer in range(1, P.num_layers + 1):
            lw.layers_ready(layer)
            await asyncio.sleep(0.01)
        out = await lw.wait(30)
        await e_md.wait(30)
        assert out["md"].bytes == P.wire_nbytes(n)
        assert _same(src, st, mdc, mt, 0, n)
        with pytest.raises(InvalidArgument):
            lw.layers_ready(P.num_layers + 1)

    run_pair(main)


def test_layer_subrange_expectation() -> None:
    async def main(pre, md, rld, src, mdc, rldc) -> None:  # type: ignore[no-untyped-def]
        n = 300
        st, mt = _table(96, P, n, 9), _table(24, MD, n, 10)
        e = md.expect(3, mt, 0, n, layers=(1, 3))
        await pre.send(3, st, {"md": e.ticket}).wait(30)
        await e.wait(30)
        assert _same(src, st, mdc, mt, 0, n, layers=(1, 3))
        assert not np.asarray(pack.pack(mdc, mt, 0, n, layers=(0, 1))).any()

    run_pair(main)


def test_bad_input_is_rejected_before_anything_moves() -> None:
    async def main(pre, md, rld, src, mdc, rldc) -> None:  # type: ignore[no-untyped-def]
        mt = _table(24, MD, 100, 11)
        e = md.expect(1, mt, 0, 100)
        with pytest.raises(InvalidArgument, match="no destination"):
            pre.send(1, _table(96, P, 100, 1), {"nowhere": e.ticket})
        with pytest.raises(InvalidArgument, match="request"):
            pre.send(2, _table(96, P, 100, 1), {"md": e.ticket})
        with pytest.raises(InvalidArgument, match="transport"):
            md.expect(4, mt, 0, 100, via="carrier-pigeon")
        with pytest.raises(Unavailable, match="ucx=True"):
            md.expect(5, mt, 0, 100, via="ucx")
        other = Ticket.decode(e.ticket)
        other = Ticket(other.transport, "1", 0, 100, 0, 4, other.compat_hash ^ 1, token=other.token)
        with pytest.raises(IncompatiblePeer):
            pre.send(1, _table(96, P, 100, 1), {"md": other.encode()})
        with pytest.raises(InvalidArgument, match="already connected"):
            await pre.connect("md", PeerConfig("tcp", *md.tcp_address))
        with pytest.raises(InvalidArgument, match="unknown transport"):
            await pre.connect("x", PeerConfig("smoke-signals"))
        with pytest.raises(PeerGone, match="nobody"):
            md.tcp.send_control("nobody", 0x80, b"")
        assert md.tcp.peer_identities() == ["p"]
        e.cancel()

    run_pair(main)


def test_mismatched_model_is_refused_at_connect() -> None:
    async def main() -> None:
        other = KVLayout(num_layers=5, num_kv_heads=2, head_dim=64, dtype="bf16")
        md = await DecodeBridge(
            pack.PagedKVCache.allocate(other, 4), tcp_listen=("127.0.0.1", 0)
        ).start()
        pre = PrefillBridge(pack.PagedKVCache.allocate(P, 4))
        with pytest.raises(IncompatiblePeer):
            await pre.connect("md", PeerConfig("tcp", *md.tcp_address, connect_timeout=5))
        await _close(pre, md)

    arun(main())


def test_cancel_from_the_sender_frees_the_receiver() -> None:
    async def main(pre, md, rld, src, mdc, rldc) -> None:  # type: ignore[no-untyped-def]
        n = 1400
        st, mt = _table(96, P, n, 12), _table(24, MD, n, 13)
        e = md.expect(5, mt, 0, n)
        lw = pre.send_layerwise(5, st, {"md": e.ticket})  # held back: no layer ready
        await asyncio.sleep(0.1)
        lw.cancel("prefill aborted")
        with pytest.raises((Cancelled, TransferAborted)):
            await e.wait(10)

    run_pair(main)


@pytest.mark.parametrize(
    "mutate, exc",
    [
        (lambda b: b"XXXX" + b[4:], RemoteProtocolError),
        (lambda b: b[:4] + bytes([9]) + b[5:], VersionMismatch),
        (lambda b: b[:10], RemoteProtocolError),
        (lambda b: b[:5] + bytes([7]) + b[6:], RemoteProtocolError),
        (lambda b: b + b"\0", RemoteProtocolError),
    ],
)
def test_ticket_rejects_malformed_bytes(mutate: object, exc: type[Exception]) -> None:
    t = Ticket(TicketTransport.TCP, "req-1", 0, 10, 0, 4, 123, token=bytes(16))
    assert Ticket.decode(t.encode()) == t
    with pytest.raises(exc):
        Ticket.decode(mutate(t.encode()))  # type: ignore[operator]


def test_ucx_ticket_round_trip() -> None:
    t = Ticket(TicketTransport.UCX, "r", 16, 48, 1, 3, 5, agent_id=b"a" * 16, block_table=(4, 2, 9))
    assert Ticket.decode(t.encode()) == t
    with pytest.raises(RemoteProtocolError):
        Ticket.decode(t.encode()[:-2])


# ---- a decode process killed mid-transfer ------------------------------------------------
def _decode_process(q: mp.Queue) -> None:  # type: ignore[type-arg]
    from kvbridge.transport.tcp import run

    async def main() -> None:
        cache = pack.PagedKVCache.allocate(MD, 64)
        md = await DecodeBridge(cache, tcp_listen=("127.0.0.1", 0)).start()
        n = 4000
        e = md.expect(1, list(range(MD.pages_for(n))), 0, n, timeout=60)
        q.put((md.tcp_address, e.ticket))
        await asyncio.sleep(60)

    run(main())


def test_decode_killed_mid_transfer_gives_a_typed_error_in_time() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_decode_process, args=(q,), daemon=True)
    proc.start()
    try:
        addr, ticket = q.get(timeout=60)

        async def main() -> None:
            src = pack.PagedKVCache.allocate(P, 256, fill="random", seed=2)
            pre = PrefillBridge(src)
            await pre.connect(
                "md",
                PeerConfig(
                    "tcp",
                    *addr,
                    streams=2,
                    chunk_size=16 << 10,
                    keepalive_interval=0.5,
                    keepalive_timeout=2.0,
                    reconnect_timeout=2.0,
                ),
            )
            lw = pre.send_layerwise(1, list(range(250)), {"md": ticket}, timeout=30)
            lw.layers_ready(1)  # some data flows, then the receiver dies
            await asyncio.sleep(0.3)
            os.kill(proc.pid, signal.SIGKILL)
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(PeerGone):
                await lw.wait(20)
            assert asyncio.get_running_loop().time() - t0 < 20
            lw.cancel()
            await pre.close()

        arun(main(), timeout=60)
    finally:
        proc.kill()
        proc.join(10)


def test_an_expectation_deadline_is_named_by_wait() -> None:
    """wait() without a limit of its own reports the expectation's deadline
    (it used to say "after None s")."""

    async def main(pre, md, rld, src, mdc, rldc) -> None:  # type: ignore[no-untyped-def]
        mt = _table(24, MD, 100, 9)
        e = md.expect("late", mt, 0, 100, timeout=0.3)
        with pytest.raises(TransferTimeout, match=r"0\.3 s"):
            await e.wait()

    run_pair(main)


def test_the_bridges_import_from_the_top_level() -> None:
    import kvbridge
    from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge

    assert kvbridge.DecodeBridge is DecodeBridge and kvbridge.PrefillBridge is PrefillBridge
    assert kvbridge.PeerConfig is PeerConfig
    with pytest.raises(AttributeError):
        kvbridge.NoSuchThing  # noqa: B018
