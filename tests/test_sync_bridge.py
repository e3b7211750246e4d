"""The synchronous bridge, driven from plain threads: several threads at
once, both paths (TCP and UCX) and the dual send, every call bounded, no
event loop in the caller's thread, a dead peer and an expired lease each
reported exactly once with the right type within its deadline, close() with
transfers pending, and every call after close() refused at once."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbridge.bridge import PeerConfig
from kvbridge.bridge.sync import BridgeEvents, SyncBridge, TransferDone, TransferFailed
from kvbridge.errors import (
    BridgeClosed,
    CallTimeout,
    Cancelled,
    ConnectTimeout,
    IncompatiblePeer,
    InvalidArgument,
    KVBridgeError,
    LeaseExpired,
    PeerGone,
    RemoteProtocolError,
    TransferAborted,
    Unavailable,
)
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)
MD = P.replace(page_tokens=64, order="page_first", head_order="HND")
MODEL = "SmolLM2-135M-Instruct"
needs_ucx = pytest.mark.skipif(not ucx.available(), reason="UCX unavailable")


def _digest(cache: pack.PagedKVCache, table: Any, n: int) -> str:
    return hashlib.sha256(bytes(np.asarray(pack.pack(cache, table, 0, n)))).hexdigest()


class Collector:
    """Every event one or several threads polled, in one place."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events = BridgeEvents()

    def add(self, ev: BridgeEvents) -> None:
        with self.lock:
            self.events.sent += ev.sent
            self.events.received += ev.received
            self.events.failed += ev.failed
            self.events.released += ev.released

    def poll_until(
        self, b: SyncBridge, done: Callable[[BridgeEvents], bool], timeout: float = 20
    ) -> BridgeEvents:
        deadline = time.monotonic() + timeout
        while True:
            self.add(b.poll())
            with self.lock:
                if done(self.events):
                    return self.events
            if time.monotonic() > deadline:
                raise AssertionError(f"events did not arrive in {timeout} s: {self.events}")
            time.sleep(0.005)


def _pair(**md_kw: Any) -> tuple[SyncBridge, SyncBridge, pack.PagedKVCache, pack.PagedKVCache]:
    src = pack.PagedKVCache.allocate(P, 256, fill="random", seed=1)
    dst = pack.PagedKVCache.allocate(MD, 64)
    md = SyncBridge(dst, identity="md", model_id=MODEL, tcp_listen=("127.0.0.1", 0), **md_kw)
    md.start()
    pre = SyncBridge(src, identity="p", model_id=MODEL).start()
    pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port, streams=2))
    return pre, md, src, dst


@pytest.fixture
def pair() -> Any:
    pre, md, src, dst = _pair()
    yield pre, md, src, dst
    pre.close()
    md.close()


# ---- several threads at once -------------------------------------------------------------------
def test_many_threads_send_and_receive_at_once(pair: Any) -> None:
    pre, md, src, dst = pair
    n_threads, per_thread, n = 6, 4, 200
    got_p, got_md = Collector(), Collector()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(per_thread):
                i = k * per_thread + j
                rid = f"t{i}"
                st = np.arange(i * 13 % 200, i * 13 % 200 + P.pages_for(n)) % 256
                mt = np.array([i * 4 + q for q in range(MD.pages_for(n))]) % 64
                ticket = md.expect(rid, mt, 0, n, timeout=30)
                pre.send(rid, st, {"md": ticket}, timeout=30)
                got_p.add(pre.poll())  # threads poll while others send
                got_md.add(md.poll())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    total = n_threads * per_thread
    ev_p = got_p.poll_until(pre, lambda e: len(e.released) == total)
    ev_md = got_md.poll_until(md, lambda e: len(e.received) == total)
    assert not ev_p.failed and not ev_md.failed
    assert Counter(d.request_id for d in ev_p.sent) == {f"t{i}": 1 for i in range(total)}
    assert Counter(ev_p.released) == {f"t{i}": 1 for i in range(total)}
    assert Counter(d.request_id for d in ev_md.received) == {f"t{i}": 1 for i in range(total)}
    assert all(d.peer == "md" and d.stats.bytes == P.wire_nbytes(n) for d in ev_p.sent)
    assert pre.pending == ([], []) and md.pending == ([], [])
    # the last writer of a page wins; check one request whose pages nobody else used
    rid_pages = np.array([0, 1, 2, 3])
    t = md.expect("last", rid_pages, 0, n)
    pre.send("last", np.arange(P.pages_for(n)), {"md": t})
    Collector().poll_until(md, lambda e: bool(e.received))
    assert _digest(src, np.arange(P.pages_for(n)), n) == _digest(dst, rid_pages, n)


# ---- no event loop in the caller's thread ----------------------------------------------------
def test_no_event_loop_in_the_callers_thread(pair: Any) -> None:
    pre, md, _, _ = pair
    seen: dict[str, Any] = {}
    handled = threading.Event()

    def on_hello(peer: str, ftype: int, payload: bytes) -> None:
        seen["thread"] = threading.current_thread().name
        seen["msg"] = (peer, ftype, payload)
        handled.set()

    def plain_thread() -> None:
        md.on_control(0x90, on_hello)
        t = md.expect("r", [0, 1, 2, 3], 0, 100)
        pre.send("r", list(range(7)), {"md": t})
        pre.send_control("md", 0x90, b"hello")
        Collector().poll_until(md, lambda e: bool(e.received))
        with pytest.raises(RuntimeError):
            asyncio.get_running_loop()
        with pytest.raises(RuntimeError):  # none was set in this thread either
            asyncio.get_event_loop_policy().get_event_loop()
        seen["ok"] = True

    th = threading.Thread(target=plain_thread, name="engine-step")
    th.start()
    th.join(30)
    assert seen.get("ok")
    assert handled.wait(10)
    assert seen["msg"] == ("p", 0x90, b"hello") and seen["thread"] == "kvbridge-md"
    assert asyncio._get_running_loop() is None
    names = {t.name for t in threading.enumerate()}
    assert {"kvbridge-md", "kvbridge-p"} <= names


# ---- control frames both ways ----------------------------------------------------------------
def test_control_frames_both_ways_and_a_raising_handler_keeps_the_connection(pair: Any) -> None:
    pre, md, _, _ = pair
    got: list[tuple[str, str, int, bytes]] = []
    arrived = threading.Event()

    def on(who: str) -> Callable[[str, int, bytes], None]:
        def fn(peer: str, t: int, payload: bytes) -> None:
            got.append((who, peer, t, payload))
            if payload == b"boom":
                raise RuntimeError("a handler bug")
            arrived.set()

        return fn

    md.on_control(0x41, on("md"))
    pre.on_control(0x42, on("p"))
    pre.send_control("md", 0x41, b"boom")  # logged; the connection stays up
    pre.send_control("md", 0x41, b"tokens")
    assert arrived.wait(10)
    arrived.clear()
    md.send_control("p", 0x42, b"ack")  # to a sender, by its identity
    assert arrived.wait(10)
    assert got == [
        ("md", "p", 0x41, b"boom"),
        ("md", "p", 0x41, b"tokens"),
        ("p", "md", 0x42, b"ack"),
    ]
    with pytest.raises(PeerGone):
        pre.send_control("nobody", 0x41, b"")
    with pytest.raises(InvalidArgument):
        pre.send_control("md", 0x12, b"")  # DATA is not a CONTROL type
    with pytest.raises(InvalidArgument):
        md.on_control(0x100, on("x"))


# ---- the big one: two threads, both paths, a dead peer, an expired lease -----------------------
def _main_decode_process(q: Any, cmd: Any) -> None:
    """A main decode in its own process: a SyncBridge listening on TCP."""
    cache = pack.PagedKVCache.allocate(MD, 256)
    md = SyncBridge(cache, identity="md", model_id=MODEL, tcp_listen=("127.0.0.1", 0)).start()
    q.put(("port", md.tcp_port))
    while True:
        c = cmd.get()
        if c[0] == "expect":
            _, rid, table, n = c
            q.put(("ticket", rid, md.expect(rid, table, 0, n, timeout=60)))
        elif c[0] == "digest":
            _, rid, table, n = c
            deadline = time.monotonic() + 30
            ev = BridgeEvents()
            while time.monotonic() < deadline and not any(d.request_id == rid for d in ev.received):
                ev.received += md.poll().received
                time.sleep(0.005)
            q.put(("digest", rid, _digest(cache, table, n)))


@needs_ucx
def test_two_threads_both_paths_a_dead_peer_and_an_expired_lease() -> None:
    ctx = mp.get_context("spawn")
    q, cmd = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_main_decode_process, args=(q, cmd), daemon=True)
    proc.start()
    src = pack.PagedKVCache.allocate(P, 256, fill="random", seed=7)
    rld_cache = pack.PagedKVCache.allocate(P, 256)
    rld = SyncBridge(rld_cache, identity="rld", model_id=MODEL, ucx=True).start()
    pre = SyncBridge(src, identity="p", model_id=MODEL, ucx=True, lease_timeout=30).start()
    got = Collector()
    errors: list[BaseException] = []
    n = 600
    try:
        kind, port = q.get(timeout=60)
        assert kind == "port"
        pre.connect("md", PeerConfig("tcp", "127.0.0.1", port, streams=2, chunk_size=16 << 10,
                                     keepalive_interval=0.5, keepalive_timeout=2.0,
                                     reconnect_timeout=2.0))  # fmt: skip
        pre.connect("rld", PeerConfig("ucx", metadata=rld.ucx_metadata()))

        def md_ticket(rid: str, table: list[int]) -> bytes:
            cmd.put(("expect", rid, table, n))
            kind, got_rid, ticket = q.get(timeout=30)
            assert (kind, got_rid) == ("ticket", rid)
            return bytes(ticket)

        def tcp_thread() -> None:  # the WAN path, then its peer dies
            try:
                for i in range(3):
                    st = list(range(i * 40, i * 40 + P.pages_for(n)))
                    mt = list(range(i * 10, i * 10 + MD.pages_for(n)))
                    pre.send(f"md{i}", st, {"md": md_ticket(f"md{i}", mt)})
                    got.add(pre.poll())
                    cmd.put(("digest", f"md{i}", mt, n))
                    kind, rid, digest = q.get(timeout=40)
                    assert (kind, rid) == ("digest", f"md{i}")
                    assert digest == _digest(src, st, n)
                ticket = md_ticket("dead", list(range(200, 200 + MD.pages_for(4000))))
                pre.send("dead", list(range(250)), {"md": ticket}, layerwise=True)
                pre.layers_ready("dead", 1)  # some data flows, then the main decode dies
                time.sleep(0.3)
                os.kill(proc.pid, signal.SIGKILL)
                got.add(pre.poll())
            except BaseException as e:
                errors.append(e)

        def ucx_thread() -> None:  # the datacenter path, then a lease runs out
            try:
                for i in range(3):
                    st = list(range(i * 40, i * 40 + P.pages_for(n)))
                    rt = list(range(200 - i * 40, 200 - i * 40 + P.pages_for(n)))
                    pre.send(f"rld{i}", st, {"rld": rld.expect(f"rld{i}", rt, 0, n, via="ucx")})
                    got.add(pre.poll())
                t = rld.expect("late", list(range(40)), 0, n, via="ucx", timeout=60)
                pre.send("late", list(range(40)), {"rld": t}, layerwise=True, lease=0.5)
                got.add(pre.poll())
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=tcp_thread), threading.Thread(target=ucx_thread)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        ev = got.poll_until(pre, lambda e: len(e.released) == 8, timeout=20)
        elapsed = time.monotonic() - t0
        failed = {f.request_id: f for f in ev.failed}
        assert len(ev.failed) == 2 and set(failed) == {"dead", "late"}
        assert isinstance(failed["dead"].error, PeerGone) and failed["dead"].peer == "md"
        assert isinstance(failed["late"].error, LeaseExpired) and failed["late"].peer == "rld"
        assert failed["late"].direction == failed["dead"].direction == "send"
        assert elapsed < 30  # the dead peer within reconnect_timeout, the lease within its 0.5 s
        assert Counter(d.request_id for d in ev.sent) == {
            **{f"md{i}": 1 for i in range(3)},
            **{f"rld{i}": 1 for i in range(3)},
        }
        assert {d.stats.path for d in ev.sent} == {"tcp", "ucx-put"}
        assert Counter(ev.released) == {r: 1 for r in [*failed, *(d.request_id for d in ev.sent)]}
        time.sleep(0.5)  # nothing more is reported: each outcome exactly once
        assert not pre.poll()
        for i in range(3):  # the relay's pages hold the prefill's KV
            st = list(range(i * 40, i * 40 + P.pages_for(n)))
            rt = list(range(200 - i * 40, 200 - i * 40 + P.pages_for(n)))
            assert _digest(src, st, n) == _digest(rld_cache, rt, n)
        ev_rld = Collector().poll_until(rld, lambda e: len(e.received) == 3 and bool(e.failed))
        (late,) = ev_rld.failed
        assert late.request_id == "late" and isinstance(late.error, TransferAborted)
        assert "lease" in str(late.error)
    finally:
        pre.close()
        rld.close()
        proc.kill()
        proc.join(10)


@needs_ucx
def test_dual_send_feeds_both_paths_from_one_call() -> None:
    src = pack.PagedKVCache.allocate(P, 64, fill="random", seed=3)
    rld_c, md_c = pack.PagedKVCache.allocate(P, 64), pack.PagedKVCache.allocate(MD, 16)
    with (
        SyncBridge(md_c, identity="md", model_id=MODEL, tcp_listen=("127.0.0.1", 0)) as md,
        SyncBridge(rld_c, identity="rld", model_id=MODEL, ucx=True) as rld,
        SyncBridge(src, identity="p", model_id=MODEL) as pre,
    ):
        pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port))
        pre.connect("rld", PeerConfig("ucx", metadata=rld.ucx_metadata()))
        n, st = 700, list(range(44))
        mt, rt = list(range(11))[::-1], list(range(20, 64))
        tickets = {"md": md.expect(1, mt, 0, n), "rld": rld.expect(1, rt, 0, n, via="ucx")}
        pre.send(1, st, tickets)
        ev = Collector().poll_until(pre, lambda e: bool(e.released))
        assert sorted(d.peer for d in ev.sent) == ["md", "rld"] and ev.released == ["1"]
        Collector().poll_until(md, lambda e: bool(e.received))
        Collector().poll_until(rld, lambda e: bool(e.received))
        assert _digest(src, st, n) == _digest(md_c, mt, n) == _digest(rld_c, rt, n)


# ---- leases through the sync bridge, on a fake clock -------------------------------------------
def test_lease_renewal_and_expiry_on_a_fake_clock() -> None:
    now = [1000.0]
    src = pack.PagedKVCache.allocate(P, 64, fill="random", seed=1)
    with (
        SyncBridge(pack.PagedKVCache.allocate(P, 64), identity="md",
                   tcp_listen=("127.0.0.1", 0)) as md,
        SyncBridge(src, identity="p", lease_timeout=10, clock=lambda: now[0]) as pre,
    ):  # fmt: skip
        pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port))
        pre.send("r", list(range(20)), {"md": md.expect("r", list(range(20)), 0, 300)},
                 layerwise=True)  # fmt: skip
        now[0] += 8
        assert pre.expire_leases() == [] and pre.renew_lease("r", 5) is True
        now[0] += 4
        assert pre.expire_leases() == []
        now[0] += 2
        assert pre.expire_leases() == ["r"]
        ev = Collector().poll_until(pre, lambda e: bool(e.released))
        (f,) = ev.failed
        assert isinstance(f.error, LeaseExpired) and ev.released == ["r"] and not ev.sent
        assert pre.renew_lease("r") is False and pre.layers_ready("r", 2) is False
        (g,) = Collector().poll_until(md, lambda e: bool(e.failed)).failed
        assert isinstance(g.error, TransferAborted) and g.direction == "recv"


# ---- cancel ------------------------------------------------------------------------------------
def test_cancel_aborts_at_both_ends_and_is_reported_once(pair: Any) -> None:
    pre, md, _, _ = pair
    t = md.expect("c", list(range(20)), 0, 1200, peer="prefill")
    pre.send("c", list(range(80)), {"md": t}, layerwise=True)
    assert pre.cancel("c", reason="the user went away") is True
    (f,) = Collector().poll_until(pre, lambda e: bool(e.released)).failed
    assert isinstance(f.error, Cancelled) and "went away" in str(f.error)
    (g,) = Collector().poll_until(md, lambda e: bool(e.failed)).failed
    assert isinstance(g.error, TransferAborted) and g.peer == "prefill"
    assert pre.cancel("c") is False and md.cancel("c") is False
    time.sleep(0.2)
    assert not pre.poll() and not md.poll()
    t2 = md.expect("d", list(range(20)), 0, 1200)  # the receiver may cancel too
    assert md.cancel("d") is True
    (h,) = Collector().poll_until(md, lambda e: bool(e.failed)).failed
    assert isinstance(h.error, Cancelled)
    with pytest.raises(KVBridgeError):  # the ticket of a cancelled expectation leads nowhere
        pre.send("d", list(range(80)), {"md": t2})
        (x,) = Collector().poll_until(pre, lambda e: bool(e.failed)).failed
        raise x.error


# ---- every call bounded -------------------------------------------------------------------------
def test_every_call_is_bounded_even_when_the_loop_thread_is_stuck() -> None:
    pre, md, _, _ = _pair(call_timeout=0.5)
    stuck = threading.Event()

    def blocking_handler(peer: str, t: int, payload: bytes) -> None:
        stuck.set()
        time.sleep(3.0)  # what a handler must never do: it stalls kvbridge's loop thread

    try:
        md.on_control(0x50, blocking_handler)
        pre.send_control("md", 0x50, b"")
        assert stuck.wait(10)
        # the calls that wait for an answer from the loop are bounded ...
        for call in (
            lambda: md.send_control("p", 0x51, b""),
            lambda: md.destinations,
            md.ucx_metadata,
        ):
            t0 = time.monotonic()
            with pytest.raises(CallTimeout, match=r"0\.5 s"):
                call()
            assert time.monotonic() - t0 < 1.5
        # ... and the engine's per-request calls do not wait for it at all
        t0 = time.monotonic()
        assert isinstance(md.expect("x", [0], 0, 10), bytes)
        assert md.cancel("x") is True
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        assert not md.poll()  # poll never waits for the loop (stuck for 3 s)
        assert time.monotonic() - t0 < 0.5
    finally:
        time.sleep(3.0)
        pre.close()
        md.close()


def test_connect_is_bounded_by_its_connect_timeout() -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers the handshake
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="p") as pre:
                t0 = time.monotonic()
                with pytest.raises(ConnectTimeout):
                    pre.connect("x", PeerConfig("tcp", "127.0.0.1", silent.getsockname()[1],
                                                connect_timeout=0.5))  # fmt: skip
                assert time.monotonic() - t0 < 2.0  # not the 10 s handshake timeout
                assert pre.destinations == []
        # the connections cut off mid-handshake were closed, not left to the loop's end
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        silent.close()


# ---- close with transfers pending, and after ------------------------------------------------------
def test_close_ends_every_pending_transfer_with_a_typed_error() -> None:
    pre, md, _, _ = _pair()
    try:
        t = md.expect("held", list(range(20)), 0, 1200)
        md.expect("never-sent", list(range(20, 40)), 0, 1200)
        pre.send("held", list(range(80)), {"md": t}, layerwise=True)
        t0 = time.monotonic()
        ev = pre.close()
        assert time.monotonic() - t0 < pre.call_timeout
        (f,) = ev.failed
        assert f.request_id == "held" and isinstance(f.error, BridgeClosed)
        assert ev.released == ["held"]
        (g,) = Collector().poll_until(md, lambda e: bool(e.failed)).failed
        assert g.request_id == "held" and isinstance(g.error, TransferAborted)  # told at once
        ev_md = md.close()
        (h,) = ev_md.failed
        assert h.request_id == "never-sent" and isinstance(h.error, BridgeClosed)
    finally:
        pre.close()
        md.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvbridge-")]


def test_every_call_after_close_raises_at_once() -> None:
    b = SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="b",
                   tcp_listen=("127.0.0.1", 0)).start()  # fmt: skip
    b.close()
    calls: list[Callable[[], object]] = [
        b.start,
        lambda: b.connect("x", PeerConfig("tcp", "127.0.0.1", 1)),
        lambda: b.expect("r", [0], 0, 1),
        lambda: b.send("r", [0], {}),
        lambda: b.layers_ready("r", 1),
        lambda: b.renew_lease("r"),
        lambda: b.cancel("r"),
        b.poll,
        lambda: b.send_control("x", 0x40, b""),
        lambda: b.on_control(0x40, lambda *a: None),
        b.ucx_metadata,
        lambda: b.tcp_port,
        b.expire_leases,
    ]
    for call in calls:
        t0 = time.monotonic()
        with pytest.raises(BridgeClosed):
            call()
        assert time.monotonic() - t0 < 0.5  # no waiting on a loop, none on a peer
    assert not b.close()  # a second close is a no-op


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_input_raises_at_once_and_leaves_nothing_pending(pair: Any) -> None:
    pre, md, _, _ = pair
    t = md.expect("r", list(range(4)), 0, 100)
    with pytest.raises(InvalidArgument, match="already expected"):
        md.expect("r", list(range(4)), 0, 100)
    with pytest.raises(InvalidArgument, match="no destination"):
        pre.send("r", list(range(7)), {"nowhere": t})
    with pytest.raises(RemoteProtocolError):
        pre.send("r", list(range(7)), {"md": b"not a ticket"})
    with pytest.raises(InvalidArgument, match="request"):
        pre.send("other", list(range(7)), {"md": t})
    with pytest.raises(InvalidArgument):
        pre.send("r", "not a table", {"md": t})
    assert pre.pending == ([], [])
    with pytest.raises(Unavailable, match="does not receive"):
        pre.expect("x", [0], 0, 10)
    with pytest.raises(Unavailable, match="ucx=False"):
        md.ucx_metadata()
    with pytest.raises(Unavailable, match="tcp_listen"):
        _ = pre.tcp_port
    with pytest.raises(InvalidArgument, match="already connected"):
        pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port))
    pre.send("r", list(range(7)), {"md": t}, layerwise=False)
    try:
        running = pre.layers_ready("r", 1)
    except InvalidArgument as e:  # still running: it was not sent layer-wise
        assert "layerwise" in str(e)
    else:  # it ended first (a loopback send of 7 pages can): no running send
        assert running is False
    Collector().poll_until(pre, lambda e: bool(e.released))
    fresh = SyncBridge(pack.PagedKVCache.allocate(P, 4))
    with pytest.raises(InvalidArgument, match="start"):
        fresh.expect("r", [0], 0, 1)
    assert not fresh.poll() and not fresh.close()
    with pytest.raises(InvalidArgument):
        SyncBridge(pack.PagedKVCache.allocate(P, 4), call_timeout=0)
    with pytest.raises(InvalidArgument):
        SyncBridge(pack.PagedKVCache.allocate(P, 4), lease_timeout=float("inf"))


def test_engines_of_different_models_refuse_each_other() -> None:
    with (
        SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="md", model_id="Qwen2-0.5B",
                   tcp_listen=("127.0.0.1", 0)) as md,
        SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="p", model_id=MODEL) as pre,
    ):  # fmt: skip
        with pytest.raises(IncompatiblePeer, match=f"model '{MODEL}' != 'Qwen2-0.5B'"):
            pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port, connect_timeout=5))
        assert pre.destinations == []


def test_events_are_typed_records() -> None:
    err = PeerGone("x")
    f = TransferFailed("r", "md", "send", err)
    assert f.error is err and not BridgeEvents() and BridgeEvents(released=["r"])
    assert TransferDone("r", "md", None).peer == "md"  # type: ignore[arg-type]


def test_a_taken_address_and_unbounded_waits_are_refused() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        b = SyncBridge(pack.PagedKVCache.allocate(P, 4), tcp_listen=taken.getsockname())
        with pytest.raises(Unavailable, match="cannot listen"):
            b.start()
        assert not [t for t in threading.enumerate() if t.name.startswith("kvbridge-")]
    with SyncBridge(pack.PagedKVCache.allocate(P, 4), identity="u",
                    tcp_listen=("127.0.0.1", 0)) as u:  # fmt: skip
        for bad in (None, 0, float("inf")):
            with pytest.raises(InvalidArgument, match="timeout"):
                u.expect("r", [0], 0, 1, timeout=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="timeout"):
                u.send("r", [0], {}, timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="ticket"):
            u.send("r", [0], {"md": "a string"})  # type: ignore[dict-item]
        assert u.pending == ([], [])


def test_a_control_handler_may_answer_but_not_block(pair: Any) -> None:
    pre, md, _, _ = pair
    answers: list[tuple[str, bytes]] = []
    outcome: dict[str, object] = {}
    done = threading.Event()

    def on_query(peer: str, t: int, payload: bytes) -> None:  # on kvbridge's thread
        md.send_control(peer, 0x61, payload[::-1])  # answering runs at once
        outcome["cancel"] = md.cancel("nothing")
        try:
            md.connect("x", PeerConfig("tcp", "127.0.0.1", 1))
        except InvalidArgument as e:
            outcome["connect"] = e

    def on_reply(peer: str, t: int, payload: bytes) -> None:
        answers.append((peer, payload))
        done.set()

    md.on_control(0x60, on_query)
    pre.on_control(0x61, on_reply)
    pre.send_control("md", 0x60, b"abc")
    assert done.wait(10)
    assert answers == [("md", b"cba")] and outcome["cancel"] is False
    assert isinstance(outcome["connect"], InvalidArgument)
