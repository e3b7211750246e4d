"""Peers resolved through the registry view, on a real etcd server and real
bridges: the prefill names a decode by engine id alone; a decode restarted
with a new generation and port is reached at its new address; a record with
another compatibility hash is refused before anything connects; an entry
that claims another engine's identity gets no bytes (the handshake decides);
static peers keep working beside resolved ones."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from etcd_server import EtcdServer, aio, until

from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge, SyncBridge
from kvbridge.errors import AuthenticationError, IncompatiblePeer
from kvbridge.layout import KVLayout
from kvbridge.registry import EngineRecord, RegistryView, Role, UnknownPeer, new_generation
from kvbridge.registry.etcd import EtcdOptions, EtcdRegistration, EtcdWatcher

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bf16", page_tokens=16)
PSK = b"fleet-secret-key" * 2
N = 200  # tokens per transfer


def record(eid: str, port: int, compat: int = P.compat_hash) -> EngineRecord:
    return EngineRecord(
        engine_id=eid, role=Role.MAIN, datacenter="dc-b", model="m", compat_hash=compat,
        generation=new_generation(), endpoints={"tcp": f"127.0.0.1:{port}"},
    )  # fmt: skip


def table(n_pages: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.permutation(n_pages)[: P.pages_for(N)].astype(np.int32)


def same_kv(a: pack.PagedKVCache, ta: np.ndarray, b: pack.PagedKVCache, tb: np.ndarray) -> bool:
    return bytes(np.asarray(pack.pack(a, ta, 0, N))) == bytes(np.asarray(pack.pack(b, tb, 0, N)))


async def decode(identity: str, psk: bytes = PSK) -> tuple[DecodeBridge, pack.PagedKVCache]:
    cache = pack.PagedKVCache.allocate(P, 64)
    md = await DecodeBridge(cache, identity=identity, tcp_listen=("127.0.0.1", 0), psk=psk).start()
    return md, cache


class Listener:
    """A plain TCP listener that counts the connections made to it."""

    def __init__(self) -> None:
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        async def on(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.accepted += 1
            w.close()

        self.server = await asyncio.start_server(on, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@aio
async def test_a_decode_is_reached_by_identity_and_again_after_its_restart(
    etcd: EtcdServer,
) -> None:
    """md-0 registers; the prefill sends to "md-0" with no address given and
    the KV lands.  md-0 then dies (its lease not revoked) and restarts on
    another port with a new generation: the next send reaches the new one
    (the prefill closed the old destination and connected again), and a
    static peer connected by address keeps working beside it."""
    opts = EtcdOptions(port=etcd.port, retry_s=0.1)
    src = pack.PagedKVCache.allocate(P, 64, fill="random", seed=1)
    view = RegistryView(compat_hash=P.compat_hash)
    watcher = EtcdWatcher(view, opts)
    await watcher.start()
    md, dst = await decode("md-0")
    reg = EtcdRegistration(record("md-0", md.tcp_address[1]), opts, ttl_s=3)
    await reg.start()
    static, sdst = await decode("md-static")
    pre = PrefillBridge(
        src, identity="p-0", resolver=view, peer_defaults=PeerConfig("tcp", psk=PSK)
    )
    try:
        await pre.connect("md-static", PeerConfig("tcp", *static.tcp_address, psk=PSK))
        await until(lambda: view.get("md-0") is not None)
        st, mt = table(64, 2), table(64, 3)
        e = md.expect("r1", mt, 0, N)
        assert "md-0" not in pre.destinations  # connected on demand, by the send
        await (await pre.send_resolved("r1", st, {"md-0": e.ticket})).wait(20)
        assert (await e.wait(20)).bytes == P.wire_nbytes(N)
        assert same_kv(src, st, dst, mt)
        assert pre.resolved is not None and pre.resolved.generation("md-0") == reg.generation

        # md-0 dies without revoking its lease, and restarts elsewhere
        old_port, old_gen = md.tcp_address[1], reg.generation
        await reg.close(revoke=False)
        await md.close()
        md, dst = await decode("md-0")
        assert md.tcp_address[1] != old_port
        reg = EtcdRegistration(record("md-0", md.tcp_address[1]), opts, ttl_s=3)
        await reg.start()
        assert reg.generation != old_gen
        await until(lambda: (r := view.get("md-0")) is not None and r.generation != old_gen)
        st2, mt2 = table(64, 4), table(64, 5)
        e2 = md.expect("r2", mt2, 0, N)
        await (await pre.send_resolved("r2", st2, {"md-0": e2.ticket})).wait(20)
        assert (await e2.wait(20)).bytes == P.wire_nbytes(N)
        assert same_kv(src, st2, dst, mt2)
        assert pre.resolved.generation("md-0") == reg.generation
        assert (pre.resolved.connects, pre.resolved.reconnects) == (2, 1)

        # the static peer, by its address, beside the resolved one
        st3, mt3 = table(64, 6), table(64, 7)
        e3 = static.expect("r3", mt3, 0, N)
        await (await pre.send_resolved("r3", st3, {"md-static": e3.ticket})).wait(20)
        await e3.wait(20)
        assert same_kv(src, st3, sdst, mt3)
        assert not pre.resolved.is_bound("md-static")
    finally:
        await pre.close()
        await reg.close()
        await md.close()
        await static.close()
        await watcher.close()


@aio
async def test_another_compat_hash_is_refused_before_any_connection(etcd: EtcdServer) -> None:
    """A record registered with another layout hash, pointing at a live
    listener: ``reach`` raises IncompatiblePeer and the listener never sees
    a connection, whether the view filters by hash (the record is skipped
    and named as incompatible) or not (the bridge checks the hash itself).
    A name with no live entry is UnknownPeer."""
    opts = EtcdOptions(port=etcd.port, retry_s=0.1)
    lis = Listener()
    port = await lis.start()
    other = P.compat_hash ^ 0xFFFF
    reg = EtcdRegistration(record("md-x", port, compat=other), opts, ttl_s=3)
    await reg.start()
    filtered = RegistryView(compat_hash=P.compat_hash)
    unfiltered = RegistryView()
    watchers = [EtcdWatcher(filtered, opts), EtcdWatcher(unfiltered, opts)]
    for w in watchers:
        await w.start()
    src = pack.PagedKVCache.allocate(P, 64)
    bridges = [
        PrefillBridge(src, identity="p-0", resolver=v, peer_defaults=PeerConfig("tcp", psk=PSK))
        for v in (filtered, unfiltered)
    ]
    try:
        await until(lambda: unfiltered.get("md-x") is not None and "md-x" in str(filtered.skipped))
        for pre in bridges:
            with pytest.raises(IncompatiblePeer, match="compat_hash"):
                await pre.reach("md-x")
            with pytest.raises(UnknownPeer):
                await pre.reach("md-nobody")
            assert pre.destinations == [] and pre.live_sends == {}
        await asyncio.sleep(0.2)
        assert lis.accepted == 0
    finally:
        for pre in bridges:
            await pre.close()
        await reg.close()
        for w in watchers:
            await w.close()
        await lis.close()


@aio
async def test_an_entry_claiming_another_identity_gets_no_bytes(etcd: EtcdServer) -> None:
    """md-0's key is taken over by impostors holding a ticket for the
    request (their own expectation, the worst case): first md-1, a fleet
    member with the fleet's key, whose handshake names it md-1 (refused: the
    prefill expects the peer to be the engine id it resolved); then a
    receiver that calls itself md-0 without the fleet's key (refused: the
    PSK proof).  Neither receives a byte, and nothing stays connected; once
    the real md-0 registers again, the send goes through."""
    opts = EtcdOptions(port=etcd.port, retry_s=0.1)
    view = RegistryView(compat_hash=P.compat_hash)
    watcher = EtcdWatcher(view, opts)
    await watcher.start()
    src = pack.PagedKVCache.allocate(P, 64, fill="random", seed=8)
    pre = PrefillBridge(
        src, identity="p-0", resolver=view, peer_defaults=PeerConfig("tcp", psk=PSK)
    )
    member, _ = await decode("md-1")
    keyless, _ = await decode("md-0", psk=b"not-the-fleet-key" * 2)
    real, rdst = await decode("md-0")
    try:
        for n, imp in enumerate((member, keyless)):
            fake = EtcdRegistration(record("md-0", imp.tcp_address[1]), opts, ttl_s=3)
            await fake.start()
            await until(lambda f=fake: (r := view.get("md-0")) is not None
                        and r.generation == f.generation)  # fmt: skip
            e = imp.expect(f"r{n}", table(64, 9), 0, N)
            with pytest.raises(AuthenticationError):
                await pre.send_resolved(f"r{n}", table(64, 10), {"md-0": e.ticket})
            await asyncio.sleep(0.2)
            assert not e.done() and e.progress == 0.0
            assert "md-0" not in pre.destinations and pre.live_sends == {}
            e.cancel("test over")
            await fake.close()
        reg = EtcdRegistration(record("md-0", real.tcp_address[1]), opts, ttl_s=3)
        await reg.start()
        await until(lambda: (r := view.get("md-0")) is not None and r.generation == reg.generation)
        st, mt = table(64, 11), table(64, 12)
        e = real.expect("ok", mt, 0, N)
        await (await pre.send_resolved("ok", st, {"md-0": e.ticket})).wait(20)
        await e.wait(20)
        assert same_kv(src, st, rdst, mt)
        await reg.close()
    finally:
        await pre.close()
        for b in (member, keyless, real):
            await b.close()
        await watcher.close()


def test_sync_bridge_sends_to_a_decode_named_by_identity(etcd: EtcdServer) -> None:
    """The SyncBridge front end: given the view (fed by a watch on another
    thread's loop), ``send`` with a ticket keyed by engine id connects and
    delivers; no ``connect`` call names an address."""
    opts = EtcdOptions(port=etcd.port, retry_s=0.1)
    view = RegistryView(compat_hash=P.compat_hash)
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    watcher = EtcdWatcher(view, opts)
    on_loop(watcher.start())
    src = pack.PagedKVCache.allocate(P, 64, fill="random", seed=13)
    dst = pack.PagedKVCache.allocate(P, 64)
    md = SyncBridge(dst, identity="md-0", tcp_listen=("127.0.0.1", 0), psk=PSK).start()
    pre = SyncBridge(
        src, identity="p-0", resolver=view, peer_defaults=PeerConfig("tcp", psk=PSK)
    ).start()
    reg = EtcdRegistration(record("md-0", md.tcp_port), opts, ttl_s=3)
    try:
        on_loop(reg.start())
        on_loop(until(lambda: view.get("md-0") is not None))
        st, mt = table(64, 14), table(64, 15)
        ticket = md.expect("s1", mt, 0, N)
        pre.send("s1", st, {"md-0": ticket})
        got: list[str] = []

        async def delivered() -> None:
            while "s1" not in got:
                got.extend(t.request_id for t in md.poll().received)
                await asyncio.sleep(0.05)

        on_loop(asyncio.wait_for(delivered(), 20))
        assert same_kv(src, st, dst, mt)
        assert pre.destinations == ["md-0"]
    finally:
        pre.close()
        md.close()
        on_loop(reg.close())
        on_loop(watcher.close())
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        loop.close()
