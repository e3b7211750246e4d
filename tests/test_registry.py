"""The registry on a real etcd server: registration, expiry and
re-registration, a watch resynced after an etcd restart, the view served
stale while etcd is down, records skipped (another compatibility hash, bad
JSON, an unknown version), and the resolver."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from etcd_server import EtcdServer, aio, until

from kvbridge.errors import IncompatiblePeer, InvalidArgument
from kvbridge.registry import (
    BadRecord,
    EngineRecord,
    LoadReport,
    RegistryView,
    Role,
    StaticResolver,
    UnknownPeer,
    decode_record,
    encode_record,
    engine_key,
    new_generation,
)
from kvbridge.registry.etcd import EtcdOptions, EtcdRegistration, EtcdWatcher, _Client

COMPAT = 0x1234_5678_9ABC_DEF0


def record(
    eid: str, role: Role = Role.MAIN, compat: int = COMPAT, port: int = 7000
) -> EngineRecord:
    return EngineRecord(
        engine_id=eid, role=role, datacenter="dc-b", model="m", compat_hash=compat,
        generation=new_generation(), endpoints={"tcp": f"127.0.0.1:{port}"},
    )  # fmt: skip


def test_record_roundtrip_and_bad_records() -> None:
    rec = record("md-0")
    rec = EngineRecord(**{**rec.__dict__, "load": LoadReport(5, 6, 7), "prefixes": (b"\x01" * 16,)})
    key = engine_key("md-0")
    assert decode_record(key, encode_record(rec)) == rec
    doc = json.loads(encode_record(rec))
    assert doc["v"] == 1 and doc["compat_hash"] == "123456789abcdef0"
    assert isinstance(decode_record(key, b"{not json"), BadRecord)
    assert "version" in decode_record(key, json.dumps({**doc, "v": 2}).encode()).reason  # type: ignore[union-attr]
    assert isinstance(decode_record(key, json.dumps({**doc, "role": "king"}).encode()), BadRecord)
    assert isinstance(decode_record(engine_key("other"), encode_record(rec)), BadRecord)
    with pytest.raises(InvalidArgument):
        record("bad/id")


def test_view_skips_and_resolves(caplog: pytest.LogCaptureFixture) -> None:
    view = RegistryView(compat_hash=COMPAT)
    good, other = record("md-0"), record("md-1", compat=1)
    with caplog.at_level(logging.WARNING, "kvbridge.registry"):
        view.load_snapshot(5, [
            (engine_key("md-0"), encode_record(good)),
            (engine_key("md-1"), encode_record(other)),
            (engine_key("md-2"), b"\xff\xfe"),
        ])  # fmt: skip
    assert [r.engine_id for r in view.engines()] == ["md-0"] and not view.stale
    assert "md-1" in caplog.text and "md-2" in caplog.text
    assert view.resolve("md-0").port == 7000
    with pytest.raises(IncompatiblePeer):
        view.resolve("md-1")
    with pytest.raises(UnknownPeer):
        view.resolve("md-9")
    # an older revision's event is not applied twice; a delete removes
    assert view.put(5, engine_key("md-0"), b"junk") == []
    (ch,) = view.delete(6, engine_key("md-0"))
    assert ch.record is None and view.get("md-0") is None
    assert StaticResolver({"d": ("h", 1)}).resolve("d").host == "h"


@aio
async def test_register_expire_reregister(etcd: EtcdServer) -> None:
    opts = EtcdOptions(port=etcd.port, retry_s=0.1)
    view = RegistryView(compat_hash=COMPAT)
    watcher = EtcdWatcher(view, opts)
    await watcher.start()
    reg = EtcdRegistration(record("p-0", Role.PREFILL), opts, ttl_s=2)
    await reg.start()
    try:
        await until(lambda: view.get("p-0") is not None)
        gen1 = view.get("p-0").generation  # type: ignore[union-attr]
        reg.report_load(LoadReport(free_blocks=11, queued_tokens=3))
        await until(lambda: view.get("p-0").load.free_blocks == 11)  # type: ignore[union-attr]
        # the lease expires (revoked behind the engine's back, as after a TTL
        # lapse): the entry leaves the view, and the engine registers again
        # with the same identity and a new generation
        admin = _Client(opts)
        await admin.revoke_lease(reg._lease.id)
        await admin.close()
        await until(lambda: view.get("p-0") is None or view.get("p-0").generation != gen1)  # type: ignore[union-attr]
        await until(lambda: view.get("p-0") is not None and view.get("p-0").generation != gen1)  # type: ignore[union-attr]
        assert reg.registrations == 2
        # an engine that stops refreshing expires after its TTL
        await reg.close(revoke=False)
        await until(lambda: view.get("p-0") is None, timeout_s=10)
    finally:
        await reg.close()
        await watcher.close()


@aio
async def test_etcd_restart_stale_view_and_resume(etcd: EtcdServer) -> None:
    opts = EtcdOptions(port=etcd.port, retry_s=0.1, timeout_s=1.0)
    view = RegistryView(compat_hash=COMPAT)
    watcher = EtcdWatcher(view, opts)
    await watcher.start()
    reg = EtcdRegistration(record("md-0"), opts, ttl_s=3)
    await reg.start()
    try:
        await until(lambda: view.get("md-0") is not None)
        etcd.stop()
        await until(lambda: view.stale)
        # served while etcd is down, marked stale
        assert view.resolve("md-0").port == 7000
        await asyncio.sleep(4)  # longer than the TTL: the lease is lost meanwhile or not
        etcd.start()
        await until(lambda: not view.stale)
        assert watcher.resyncs >= 2
        # registrations resumed: a put after the restart reaches the view
        reg.report_load(LoadReport(free_blocks=42))
        await until(
            lambda: view.get("md-0") is not None and view.get("md-0").load.free_blocks == 42
        )  # type: ignore[union-attr]
        # a new engine registered after the restart is seen through the new watch
        reg2 = EtcdRegistration(record("md-1", port=7001), opts, ttl_s=3)
        await reg2.start()
        await until(lambda: view.get("md-1") is not None)
        await reg2.close()
        await until(lambda: view.get("md-1") is None)
    finally:
        await reg.close()
        await watcher.close()


@aio
async def test_bad_records_in_etcd_are_skipped(etcd: EtcdServer) -> None:
    opts = EtcdOptions(port=etcd.port, retry_s=0.1)
    admin = _Client(opts)
    await admin.put(engine_key("x-0").encode(), b"\x00garbage")
    await admin.put(engine_key("x-1").encode(), json.dumps({"v": 9}).encode())
    await admin.put(engine_key("x-2").encode(), encode_record(record("x-2", compat=7)))
    view = RegistryView(compat_hash=COMPAT)
    watcher = EtcdWatcher(view, opts)
    await watcher.start()
    try:
        await admin.put(engine_key("x-3").encode(), encode_record(record("x-3")))
        await admin.put(engine_key("x-4").encode(), b"[]")
        await until(lambda: view.get("x-3") is not None and engine_key("x-4") in view.skipped)
        assert [r.engine_id for r in view.engines()] == ["x-3"]
        assert set(view.skipped) == {engine_key(k) for k in ("x-0", "x-1", "x-2", "x-4")}
        with pytest.raises(IncompatiblePeer):
            view.resolve("x-2")
    finally:
        await watcher.close()
        await admin.close()


@aio
async def test_impostor_entry_gets_no_bytes(etcd: EtcdServer) -> None:
    """An entry that claims md-0's identity (its key, its id) but points at
    another receiver: the prefill resolves it through the view, and the
    kvbridge handshake (PSK) refuses; the impostor receives nothing."""
    from kvbridge.errors import AuthenticationError
    from kvbridge.transport.tcp import TcpReceiver, TcpSender
    from kvbridge.transport.tcp.kvio import BytesSink, BytesSource

    opts = EtcdOptions(port=etcd.port, retry_s=0.1)
    impostor = await TcpReceiver(psk=b"impostor-key" * 3).start()
    sink = impostor.expect("req-1", BytesSink(4096))
    view = RegistryView(compat_hash=COMPAT)
    watcher = EtcdWatcher(view, opts)
    await watcher.start()
    fake = EtcdRegistration(record("md-0", port=impostor.port), opts, ttl_s=3)
    await fake.start()
    try:
        await until(lambda: view.get("md-0") is not None)
        addr = view.resolve("md-0")
        assert addr.port == impostor.port
        tx = TcpSender(addr.host, addr.port, identity="p-0", psk=b"fleet-key" * 4, streams=1)
        with pytest.raises(AuthenticationError):
            await tx.send("req-1", BytesSource(b"k" * 4096), token=sink.token).wait(10)
        assert sink.received_bytes == 0
        await tx.close()
    finally:
        sink.cancel()
        await fake.close()
        await watcher.close()
        await impostor.close()
