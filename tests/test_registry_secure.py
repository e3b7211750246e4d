"""The registry on an etcd that asks for TLS client certificates and for a
user name and password (etcd's own role-based access), and a watch whose
start revision was compacted away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd_server import EtcdServer, until
from tcp_support import make_certs

from kvbridge.errors import AuthenticationError
from kvbridge.registry import EngineRecord, RegistryView, Role, new_generation
from kvbridge.registry.etcd import EtcdOptions, EtcdRegistration, EtcdWatcher, _Client

COMPAT = 77


def record(eid: str, port: int = 7000) -> EngineRecord:
    return EngineRecord(
        engine_id=eid, role=Role.MAIN, datacenter="dc-b", model="m", compat_hash=COMPAT,
        generation=new_generation(), endpoints={"tcp": f"127.0.0.1:{port}"},
    )  # fmt: skip


@pytest.fixture
def secure_etcd(tmp_path: Path) -> Iterator[tuple[EtcdServer, dict[str, Path]]]:
    certs = make_certs(tmp_path)
    tls = {
        "ca": certs["ca"], "cert": certs["server"], "key": certs["server_key"],
        "client_cert": certs["client"], "client_key": certs["client_key"],
    }  # fmt: skip
    srv = EtcdServer(tmp_path / "etcd", tls=tls)
    srv.start()
    # etcd's access control: root, and a user that may read and write kvbridge's keys only
    srv.etcdctl("user", "add", "root", "--new-user-password=rootpw")
    srv.etcdctl("user", "add", "kv", "--new-user-password=kvpw")
    srv.etcdctl("role", "add", "kvbridge")
    srv.etcdctl("role", "grant-permission", "kvbridge", "--prefix=true", "readwrite", "/kvbridge/")
    srv.etcdctl("user", "grant-role", "kv", "kvbridge")
    srv.etcdctl("auth", "enable")
    yield srv, certs
    srv.stop()


def test_tls_client_certificate_and_password(
    secure_etcd: tuple[EtcdServer, dict[str, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    srv, certs = secure_etcd

    async def go() -> None:
        good = EtcdOptions(
            port=srv.port, ca_file=str(certs["ca"]), cert_file=str(certs["client"]),
            key_file=str(certs["client_key"]), username="kv", password="kvpw", retry_s=0.1,
        )  # fmt: skip
        view = RegistryView(compat_hash=COMPAT)
        watcher = EtcdWatcher(view, good)
        await watcher.start()
        reg = EtcdRegistration(record("md-0"), good, ttl_s=3)
        await reg.start()
        try:
            await until(lambda: view.get("md-0") is not None)
            # a wrong password: refused by etcd, typed, at once (not retried until a timeout)
            bad = EtcdOptions(
                port=srv.port, ca_file=str(certs["ca"]), cert_file=str(certs["client"]),
                key_file=str(certs["client_key"]), username="kv", password="nope",
            )  # fmt: skip
            with pytest.raises(AuthenticationError):
                await EtcdRegistration(record("md-1"), bad, ttl_s=3).start(timeout_s=5)
            with pytest.raises(AuthenticationError):
                await EtcdWatcher(RegistryView(), bad).start(timeout_s=5)
            # no client certificate: the TLS handshake fails; nothing registers
            nocert = EtcdOptions(
                port=srv.port, ca_file=str(certs["ca"]), username="kv", password="kvpw",
                timeout_s=1.0, retry_s=0.2,
            )  # fmt: skip
            stray = EtcdRegistration(record("md-2"), nocert, ttl_s=3)
            with caplog.at_level(logging.WARNING, "kvbridge.registry"), pytest.raises(TimeoutError):
                await stray.start(timeout_s=3)
            await stray.close()
            assert "etcd unreachable" in caplog.text
            # the user may not write outside kvbridge's prefix (etcd's roles hold)
            admin = _Client(good)
            with pytest.raises(Exception, match="permission denied"):
                await admin.put(b"/other/x", b"1")
            await admin.close()
            assert view.get("md-1") is None and view.get("md-2") is None
        finally:
            await reg.close()
            await watcher.close()

    asyncio.run(asyncio.wait_for(go(), 90))


def test_watch_from_a_compacted_revision_resyncs(tmp_path: Path) -> None:
    srv = EtcdServer(tmp_path / "etcd")
    srv.start()

    async def go() -> None:
        opts = EtcdOptions(port=srv.port, retry_s=0.1)
        admin = _Client(opts)
        view = RegistryView(compat_hash=COMPAT)
        watcher = EtcdWatcher(view, opts)
        real_watch = watcher._client.__class__.watch_prefix
        compacted: list[int] = []

        async def racing_watch(self, key, start_revision=None, **kw):  # type: ignore[no-untyped-def]
            # between the listing and the watch, engines change and the
            # history is compacted past the watch's start revision
            if not compacted:
                reg = EtcdRegistration(record("md-late", port=7100), opts, ttl_s=5)
                await reg.start()
                regs.append(reg)
                await admin.put(b"/elsewhere", b"1")  # one more revision past the start
                now = (await admin.get(b"/elsewhere")).mod_revision
                assert start_revision is not None and now > start_revision
                await admin.compact(now)
                compacted.append(now)
            return await real_watch(self, key, start_revision=start_revision, **kw)

        regs: list[EtcdRegistration] = []
        type(watcher._client).watch_prefix = racing_watch  # type: ignore[method-assign]
        try:
            await watcher.start()
            # the watch from the compacted revision fails; the view lists again
            # and holds the engine that registered in the gap
            await until(lambda: view.get("md-late") is not None)
            assert compacted and watcher.resyncs >= 2
        finally:
            type(watcher._client).watch_prefix = real_watch  # type: ignore[method-assign]
            for r in regs:
                await r.close()
            await watcher.close()
            await admin.close()

    try:
        asyncio.run(asyncio.wait_for(go(), 90))
    finally:
        srv.stop()
