"""One regression test per failure class that the anchors (vLLM's NIXL and
Mooncake connectors, SGLang's PD, NIXL) shipped, on real bridges over
loopback (docs/reliability.md lists them with their origin):

(a) a connection that lives long and then loses its peer: the survivor
    notices, drops the dead peer and reconnects to its restarted process;
(b) a peer that restarts with the same identity is reconnected (decode
    restarts: tests/test_reliability.py; here: a prefill that restarts);
(c) a sender that dies during the handshake leaves the receiver serving;
(d) a send that fails to post is raised to the caller and the decode is
    told, instead of waiting for its deadline;
(e) finished writes are reported at once: the source pages' lease is
    released when the send completes, not when the lease runs out;
(f) the leases of 128 concurrent sends are renewed in time and none expires;
(g) a request aborted at the decode while its KV is on the way frees both
    ends: the expectation fails typed, the prefill's send ends and releases
    its lease, and the pages take a new transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from decode_proc import PAGES, DecodeProc, layout
from tcp_support import arun

from kvbridge.errors import Cancelled, KVBridgeError, PageIndexError, TransferTimeout
from kvbridge.transport import ucx

pytest.importorskip("kvbridge._core")
from kvbridge import pack
from kvbridge.bridge import DecodeBridge, PeerConfig, PrefillBridge

pytestmark = pytest.mark.timeout(400)  # processes started and killed: minutes on a loaded VM
FAST = {"keepalive_interval": 0.5, "keepalive_timeout": 3.0}
UCX_FAST = {"heartbeat": 0.25, "peer_timeout": 5.0}
NEEDS_UCX = pytest.mark.skipif(not ucx.available(), reason="UCX unavailable")
KINDS = ["tcp", pytest.param("ucx", marks=NEEDS_UCX)]


def same(src: Any, st: Any, dst: Any, mt: Any, n: int) -> bool:
    a = hashlib.sha256(bytes(np.asarray(pack.pack(src, st, 0, n)))).digest()
    return a == hashlib.sha256(bytes(np.asarray(pack.pack(dst, mt, 0, n)))).digest()


async def pair(kind: str, **pre_kw: Any) -> tuple[Any, Any, PrefillBridge, DecodeBridge]:
    lay = layout()
    src = pack.PagedKVCache.allocate(lay, PAGES, fill="random", seed=11)
    dst = pack.PagedKVCache.allocate(lay, PAGES)
    if kind == "tcp":
        md = await DecodeBridge(dst, identity="md", tcp_listen=("127.0.0.1", 0), **FAST).start()
        cfg = PeerConfig("tcp", *md.tcp_address, **FAST)
    else:
        md = await DecodeBridge(dst, identity="md", ucx=True, ucx_options=UCX_FAST).start()
        cfg = PeerConfig("ucx", metadata=md.ucx_metadata())
    pre = PrefillBridge(src, identity="p", ucx_options=UCX_FAST, **pre_kw)
    await pre.connect("md", cfg)
    return src, dst, pre, md


def tables(i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    k = layout().pages_for(n)
    st = np.arange(i * k, (i + 1) * k, dtype=np.int32)
    return st, st[::-1].copy()


async def settle(cond: Any, seconds: float = 5.0) -> bool:
    """Let callbacks run until ``cond()`` (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not cond() and loop.time() < end:
        await asyncio.sleep(0.01)
    return bool(cond())


# ---- (a) a long-lived connection loses its peer ------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_idle_peer_lost_is_dropped_and_its_restart_reconnected(kind: str) -> None:
    async def main() -> None:
        lay = layout()
        src = pack.PagedKVCache.allocate(lay, PAGES, fill="random", seed=2)
        peer = DecodeProc(kind)
        await peer.start()
        pre = PrefillBridge(src, identity="p", ucx_options=UCX_FAST)
        cfg = (
            PeerConfig("tcp", "127.0.0.1", peer.port, **FAST)
            if kind == "tcp"
            else PeerConfig("ucx", "127.0.0.1", peer.port)
        )
        try:
            await pre.connect("d", cfg)

            async def transfer(rid: str) -> None:
                n = 700
                st, mt = tables(1, n)
                ticket, rx = await peer.expect(rid, [int(x) for x in mt], n, 20)
                assert ticket is not None
                await pre.send(rid, st, {"d": ticket}, timeout=20).wait(25)
                out = await asyncio.wait_for(rx, 25)
                want = hashlib.sha256(bytes(np.asarray(pack.pack(src, st, 0, n)))).hexdigest()
                assert out.get("sha") == want, out

            await transfer("before")
            await asyncio.sleep(1.5)  # idle: several heartbeats / keepalives
            peer.kill()  # REMOTE_DISCONNECT for the survivor
            if kind == "ucx":
                agent = pre._ensure_ucx()
                assert await settle(lambda: not agent.peers, 10), "the dead peer was not dropped"
            else:
                sender = pre.tcp_sender("d")
                assert await settle(lambda: not sender._links.live, 10)
            await peer.start()  # the same identity and address, a new process
            await transfer("after")  # no restart of the survivor
        finally:
            await pre.close()
            peer.close()

    arun(main(), 180)


# ---- (b) a prefill that restarts with the same identity ----------------------------------------
_PREFILL_CHILD = r"""
import asyncio, sys, numpy as np
from kvbridge import pack
from kvbridge.bridge import PrefillBridge, PeerConfig
sys.path.insert(0, sys.argv[1])
from decode_proc import layout, PAGES
kind, addr, ticket, n = sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4]), int(sys.argv[5])
async def main():
    src = pack.PagedKVCache.allocate(layout(), PAGES, fill="random", seed=int(sys.argv[6]))
    pre = PrefillBridge(src, identity="p")
    if kind == "tcp":
        host, port = addr.split(":")
        await pre.connect("d", PeerConfig("tcp", host, int(port)))
    else:
        await pre.connect("d", PeerConfig("ucx", metadata=bytes.fromhex(addr)))
    k = layout().pages_for(n)
    d = pre.send("r", np.arange(k, dtype=np.int32), {"d": ticket}, timeout=20)
    if sys.argv[7] == "die":
        await asyncio.sleep(0.01)
        import os; os._exit(9)          # a crash: no goodbye, connections reset
    await d.wait(25)
    await pre.close()
    print("sent", flush=True)
asyncio.run(main())
"""


@pytest.mark.parametrize("kind", KINDS)
def test_b_prefill_restarted_with_same_identity_is_served(kind: str, tmp_path: Any) -> None:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "prefill_child.py"
    script.write_text(_PREFILL_CHILD)

    async def main() -> None:
        lay = layout()
        dst = pack.PagedKVCache.allocate(lay, PAGES)
        ucx_kw = {"ucx": True, "ucx_options": UCX_FAST} if kind == "ucx" else {}
        md = await DecodeBridge(
            dst, identity="md", tcp_listen=("127.0.0.1", 0), **FAST, **ucx_kw
        ).start()
        addr = "{}:{}".format(*md.tcp_address) if kind == "tcp" else md.ucx_metadata().hex()
        n = 900
        try:
            for gen in range(3):
                rid = f"r{gen}"
                k = lay.pages_for(n)
                mt = np.arange(k, dtype=np.int32)[::-1].copy()
                e = md.expect("r", mt, 0, n, via=kind, timeout=20)
                how = "die" if gen < 2 else "live"
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, str(script), here, kind, addr, e.ticket.hex(), str(n),
                    str(gen), how, stdout=subprocess.PIPE,
                )  # fmt: skip
                out, _ = await asyncio.wait_for(proc.communicate(), 120)
                if how == "die":
                    # the crashed prefill's transfer ends typed at the decode, in time
                    with contextlib.suppress(KVBridgeError):
                        await e.wait(30)
                    assert e.done(), rid
                    continue
                assert b"sent" in out
                await e.wait(30)
                src = pack.PagedKVCache.allocate(lay, PAGES, fill="random", seed=gen)
                assert same(src, np.arange(k, dtype=np.int32), dst, mt, n)
        finally:
            await md.close()

    arun(main(), 400)


# ---- (c) a sender that dies during the handshake -----------------------------------------------
def test_c_sender_dead_mid_handshake_leaves_receiver_serving() -> None:
    async def main() -> None:
        errors: list[Any] = []
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: errors.append(ctx))
        src, dst, pre, md = await pair("tcp")
        try:
            host, port = md.tcp_address
            for cut in (0, 3, 9, 40):  # bytes of a HELLO frame before the crash
                s = socket.create_connection((host, port))
                hello = b"KVBR" + bytes(range(60))
                if cut:
                    s.sendall(hello[:cut])
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()  # RST, as a killed process's kernel sends
            await asyncio.sleep(0.3)
            n = 1000
            st, mt = tables(0, n)
            e = md.expect("x", mt, 0, n, timeout=20)
            await pre.send("x", st, {"md": e.ticket}, timeout=20).wait(25)
            await e.wait(5)
            assert same(src, st, dst, mt, n)
            assert not errors, errors[:2]
        finally:
            await pre.close()
            await md.close()

    arun(main(), 60)


@NEEDS_UCX
def test_c_ucx_initiator_dead_after_hello_leaves_acceptor_serving(tmp_path: Any) -> None:
    """The case below runs in a child process: in about 1 run of 12 on a
    2-core x86 VM, UCX's TCP transport (the libucx wheel) crashes the
    acceptor with SIGSEGV in ``ucp_wireup_ep_test``, called from
    ``ucp_worker_iface_error_handler`` while ``uct_tcp`` reconnects the dead
    initiator's endpoint during wireup (docs/reliability.md, "Known crash").
    That crash is reported as an expected failure; any other failure fails."""
    import os
    import signal

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys, pathlib; sys.path.insert(0, {here!r}); import test_failure_classes as t; "
        f"t._initiator_dead_after_hello_case(pathlib.Path({str(tmp_path)!r}))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, UCX_TLS="tcp"),
    )  # fmt: skip
    if r.returncode == -signal.SIGSEGV:
        pytest.xfail("UCX wireup crash in the acceptor (SIGSEGV in ucp_wireup_ep_test)")
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])


def _initiator_dead_after_hello_case(tmp_path: Any) -> None:
    """The initiator's HELLO arrives and its process is gone before the ACK:
    the acceptor's HELLO callback must not fail (the anchors' KeyError)."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "hello_and_die.py"
    script.write_text(
        "import asyncio, os, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from decode_proc import layout, PAGES\n"
        "from kvbridge import pack\n"
        "from kvbridge.bridge import PrefillBridge, PeerConfig\n"
        "async def main():\n"
        "    pre = PrefillBridge(pack.PagedKVCache.allocate(layout(), PAGES), identity='p')\n"
        "    t = asyncio.ensure_future(pre.connect('d', PeerConfig('ucx', metadata=bytes.fromhex(sys.argv[2]))))\n"
        "    await asyncio.sleep(float(sys.argv[3]))\n"
        "    os._exit(9)\n"
        "asyncio.run(main())\n"
    )

    async def main() -> None:
        errors: list[Any] = []
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: errors.append(ctx))
        src, dst, pre, md = await pair("ucx")
        try:
            for delay in (0.0, 0.002, 0.02):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, str(script), here, md.ucx_metadata().hex(), str(delay),
                    env=dict(os.environ, UCX_TLS="tcp"),
                )  # fmt: skip
                await asyncio.wait_for(proc.wait(), 120)
            await asyncio.sleep(3)  # heartbeats: the dead initiators are dropped
            n = 1000
            st, mt = tables(0, n)
            e = md.expect("x", mt, 0, n, via="ucx", timeout=20)
            await pre.send("x", st, {"md": e.ticket}, timeout=20).wait(25)
            await e.wait(5)
            assert same(src, st, dst, mt, n)
            assert not errors, errors[:2]
        finally:
            await pre.close()
            await md.close()

    arun(main(), 300)


# ---- (d) a send that fails to post --------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_d_send_that_fails_to_post_is_raised_and_releases_its_lease(kind: str) -> None:
    async def main() -> None:
        src, dst, pre, md = await pair(kind, lease_timeout=300)
        try:
            n = 500
            st, mt = tables(0, n)
            e = md.expect("bad", mt, 0, n, via=kind, timeout=30)
            bad = st.copy()
            bad[0] = PAGES + 7  # not a page of the source cache
            with pytest.raises(PageIndexError):
                pre.send("bad", bad, {"md": e.ticket}, timeout=30)
            assert "bad" not in pre.leases and not pre.live_sends
            if kind == "ucx":  # the decode is told: it does not wait for its deadline
                with pytest.raises(KVBridgeError) as ei:
                    await e.wait(10)
                assert not isinstance(ei.value, TransferTimeout), ei.value
            else:
                e.cancel("the prefill refused the send")
            # the same request goes through once the table is right
            e2 = md.expect("good", mt, 0, n, via=kind, timeout=30)
            await pre.send("good", st, {"md": e2.ticket}, timeout=30).wait(35)
            await e2.wait(5)
            assert same(src, st, dst, mt, n)
        finally:
            await pre.close()
            await md.close()

    arun(main(), 90)


# ---- (e) finished writes are reported: the lease ends with the send ----------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_e_finished_sends_release_their_lease_at_once(kind: str) -> None:
    async def main() -> None:
        src, dst, pre, md = await pair(kind, lease_timeout=300)
        done: list[str] = []
        try:
            jobs = []
            for i in range(8):
                n = 300 + 97 * i
                st, mt = tables(i, n)
                e = md.expect(f"q{i}", mt, 0, n, via=kind, timeout=30)
                g = pre.send(f"q{i}", st, {"md": e.ticket}, timeout=30)
                g.on_done(lambda grp: done.append(grp.request_id))
                jobs.append((g, e, st, mt, n))
            for g, e, st, mt, n in jobs:
                await g.wait(35)
                await e.wait(5)
                assert same(src, st, dst, mt, n)
            # far before the 300 s lease: every lease is released, every on_done ran
            assert await settle(lambda: len(pre.leases) == 0 and not pre.live_sends)
            assert sorted(done) == sorted(f"q{i}" for i in range(8))
        finally:
            await pre.close()
            await md.close()

    arun(main(), 90)


# ---- (f) 128 concurrent leases kept alive -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_f_128_concurrent_sends_keep_their_leases(kind: str) -> None:
    async def main() -> None:
        src, dst, pre, md = await pair(kind, lease_timeout=3.0)
        lay = layout()
        try:
            jobs = []
            n = 30  # two pages each: 128 sends use 256 of the 512 pages
            for i in range(128):
                st, mt = tables(i, n)
                e = md.expect(f"q{i}", mt, 0, n, via=kind, timeout=60)
                g = pre.send_layerwise(f"q{i}", st, {"md": e.ticket}, timeout=60, layer_timeout=60)
                jobs.append((g, e, st, mt))
            stop = asyncio.Event()

            async def heartbeat() -> None:  # what the decode's lease heartbeats do
                while not stop.is_set():
                    for i in range(128):
                        pre.renew_lease(f"q{i}")
                    await asyncio.sleep(0.25)

            hb = asyncio.ensure_future(heartbeat())
            # the layers come over 4 s: longer than a lease, so only renewals keep them
            for layer in range(1, lay.num_layers + 1):
                await asyncio.sleep(1.0)
                for g, _e, _st, _mt in jobs:
                    g.layers_ready(layer)
            results = await asyncio.gather(
                *(g.wait(60) for g, _e, _st, _mt in jobs), return_exceptions=True
            )
            stop.set()
            await hb
            bad = [r for r in results if isinstance(r, BaseException)]
            assert not bad, f"{len(bad)} of 128 failed, e.g. {bad[0]!r}"
            for _g, e, st, mt in jobs:
                await e.wait(10)
                assert same(src, st, dst, mt, n)
            assert await settle(lambda: len(pre.leases) == 0)
        finally:
            await pre.close()
            await md.close()

    arun(main(), 180)


# ---- (g) a request aborted while its KV is on the way -------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_g_request_aborted_while_waiting_frees_both_ends(kind: str) -> None:
    async def main() -> None:
        src, dst, pre, md = await pair(kind, lease_timeout=300)
        try:
            n = 1200
            st, mt = tables(0, n)
            e = md.expect("a", mt, 0, n, via=kind, timeout=30)
            g = pre.send_layerwise("a", st, {"md": e.ticket}, timeout=30, layer_timeout=30)
            g.layers_ready(1)  # some KV is on the way, the rest waits for prefill
            await asyncio.sleep(0.3)
            e.cancel("request aborted by the scheduler")
            with pytest.raises(Cancelled):
                await e.wait(5)
            # the decode frees the pages: they hold other data from now on
            sentinel = bytes(np.asarray(pack.pack(dst, mt, 0, n)))
            if kind == "ucx":
                # (the one-sided puts: what the sender posts before the decode's
                # ABORT reaches it still lands: docs/reliability.md, class g)
                peer = pre.destination("md").peer
                assert await settle(lambda: "a" in peer._aborted), "the ABORT did not arrive"
            # the prefill goes on computing layers; its send ends typed, long
            # before its 30 s deadline, frees its pages, and writes nothing more
            for layer in range(2, layout().num_layers + 1):
                with contextlib.suppress(KVBridgeError):
                    g.layers_ready(layer)
            with pytest.raises(KVBridgeError) as ei:
                await g.wait(15)
            assert not isinstance(ei.value, TransferTimeout), ei.value
            assert await settle(lambda: "a" not in pre.leases and not pre.live_sends)
            await asyncio.sleep(0.5)
            assert bytes(np.asarray(pack.pack(dst, mt, 0, n))) == sentinel, "written after abort"
            # the decode's pages take a new transfer, and nothing of the old one lands later
            e2 = md.expect("b", mt, 0, n, via=kind, timeout=30)
            await pre.send("b", st, {"md": e2.ticket}, timeout=30).wait(35)
            await e2.wait(5)
            assert same(src, st, dst, mt, n)
        finally:
            await pre.close()
            await md.close()

    arun(main(), 90)
