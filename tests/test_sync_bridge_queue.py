"""The synchronous bridge's calls return without waiting for kvbridge's loop
thread: ``expect``, ``send``, ``layers_ready``, ``renew_lease`` and ``cancel``
check their arguments in the caller's thread (bad ones raise there, with
nothing queued), queue the work and return, also while the loop thread is
stuck.  The documented contract still holds: every outcome exactly once
through ``poll()`` (under concurrency, with cancels racing sends, with work
still queued at ``close()``), what only the loop can find reported as a
typed ``failed`` outcome, and every deadline kept."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvbridge.bridge import PeerConfig
from kvbridge.bridge.sync import BridgeEvents, SyncBridge
from kvbridge.errors import (
    BridgeClosed,
    Cancelled,
    InvalidArgument,
    KVBridgeError,
    LayoutError,
    PageIndexError,
    TransferAborted,
    TransferTimeout,
)
from kvbridge.layout import KVLayout
from kvbridge.registry import RegistryView, UnknownPeer

pytest.importorskip("kvbridge._core")
from kvbridge import pack

P = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bf16", page_tokens=16)
MODEL = "SmolLM2-135M-Instruct"
STALL = 2.0  # how long a test holds a loop thread in a control handler


class Events:
    """Every event polled from one bridge, kept."""

    def __init__(self, b: SyncBridge) -> None:
        self.b = b
        self.all = BridgeEvents()
        self.lock = threading.Lock()

    def add(self, ev: BridgeEvents) -> None:
        with self.lock:
            self.all.sent += ev.sent
            self.all.received += ev.received
            self.all.failed += ev.failed
            self.all.released += ev.released

    def until(self, done: Callable[[BridgeEvents], bool], timeout: float = 30) -> BridgeEvents:
        deadline = time.monotonic() + timeout
        while True:
            self.add(self.b.poll())
            if done(self.all):
                return self.all
            if time.monotonic() > deadline:
                raise AssertionError(f"events did not arrive in {timeout} s: {self.all}")
            time.sleep(0.005)


def _pair(
    **pre_kw: Any,
) -> tuple[SyncBridge, SyncBridge, pack.PagedKVCache, pack.PagedKVCache]:
    src = pack.PagedKVCache.allocate(P, 128, fill="random", seed=5)
    dst = pack.PagedKVCache.allocate(P, 128)
    md = SyncBridge(dst, identity="md", model_id=MODEL, tcp_listen=("127.0.0.1", 0)).start()
    pre = SyncBridge(src, identity="p", model_id=MODEL, **pre_kw).start()
    pre.connect("md", PeerConfig("tcp", "127.0.0.1", md.tcp_port, streams=2))
    return pre, md, src, dst


@pytest.fixture
def pair() -> Iterator[tuple[SyncBridge, SyncBridge, pack.PagedKVCache, pack.PagedKVCache]]:
    pre, md, src, dst = _pair()
    try:
        yield pre, md, src, dst
    finally:
        pre.close()
        md.close()


@contextmanager
def stalled(b: SyncBridge) -> Iterator[threading.Event]:
    """Hold ``b``'s loop thread busy for STALL seconds (a blocking function
    run there, as a CONTROL handler that blocks would); yields an event set
    when the stall ends."""
    inside, over = threading.Event(), threading.Event()

    def block() -> None:
        inside.set()
        time.sleep(STALL)
        over.set()

    lt = b._loop  # the bridge's loop thread
    assert lt is not None
    lt.submit(block)
    assert inside.wait(10)
    yield over


def _same(src: Any, st: Any, dst: Any, mt: Any, n: int) -> bool:
    a = np.asarray(pack.pack(src, st, 0, n))
    b = np.asarray(pack.pack(dst, mt, 0, n))
    return bool(np.array_equal(a, b))


# ---- the calls return while the loop thread is stuck ------------------------------------------
def test_calls_return_while_the_loop_thread_is_stuck_and_their_work_runs_after(pair: Any) -> None:
    """With both loop threads held for STALL seconds, expect, send,
    layers_ready, renew_lease and poll return at once (the loop runs none of
    them meanwhile); once the loops run again the transfer completes, each
    outcome once.  The receiver's loop sees the sender's OPEN and its own
    queued expect in whichever order: the OPEN's token is found either way."""
    pre, md, src, dst = pair
    n = 300
    st, mt = list(range(P.pages_for(n))), list(range(40, 40 + P.pages_for(n)))
    with stalled(md) as md_free, stalled(pre) as pre_free:
        t0 = time.monotonic()
        ticket = md.expect("q", mt, 0, n, timeout=30)
        pre.send("q", st, {"md": ticket}, layerwise=True, timeout=30)
        assert pre.layers_ready("q", 2) is True
        assert pre.renew_lease("q", 20.0) is True
        assert pre.layers_ready("q", P.num_layers) is True
        assert not pre.poll() and not md.poll()
        assert pre.pending == (["q"], []) and md.pending == ([], ["q"])
        returned = time.monotonic() - t0
        assert not md_free.is_set() and not pre_free.is_set()  # nothing ran on the loops
    assert returned < STALL
    ev_p = Events(pre).until(lambda e: bool(e.released))
    ev_md = Events(md).until(lambda e: bool(e.received))
    assert [d.request_id for d in ev_p.sent] == ["q"] and ev_p.released == ["q"]
    assert not ev_p.failed and not ev_md.failed
    assert [d.request_id for d in ev_md.received] == ["q"]
    assert _same(src, st, dst, mt, n)
    time.sleep(0.2)
    assert not pre.poll() and not md.poll()


def test_cancel_before_the_loop_picked_the_send_up_aborts_at_both_ends(pair: Any) -> None:
    pre, md, _, _ = pair
    ticket = md.expect("c", list(range(20)), 0, 300, peer="prefill")
    with stalled(pre):
        pre.send("c", list(range(20)), {"md": ticket})
        assert pre.cancel("c", reason="the user went away") is True
        assert pre.cancel("c", reason="twice") is True  # still pending: one outcome anyway
    ev = Events(pre).until(lambda e: bool(e.released))
    (f,) = ev.failed
    assert isinstance(f.error, Cancelled) and "went away" in str(f.error)
    assert not ev.sent and ev.released == ["c"]
    (g,) = Events(md).until(lambda e: bool(e.failed)).failed  # the receiver heard at once
    assert isinstance(g.error, TransferAborted) and g.peer == "prefill"
    assert pre.cancel("c") is False


def test_cancel_before_the_loop_registered_the_expect(pair: Any) -> None:
    pre, md, _, _ = pair
    with stalled(md):
        ticket = md.expect("e", list(range(20)), 0, 300)
        assert md.cancel("e") is True
        assert md.pending == ([], ["e"])
    (g,) = Events(md).until(lambda e: bool(e.failed)).failed
    assert isinstance(g.error, Cancelled) and g.direction == "recv"
    assert md.pending == ([], [])
    pre.send("e", list(range(20)), {"md": ticket})  # its ticket now leads nowhere
    (f,) = Events(pre).until(lambda e: bool(e.released)).failed
    assert isinstance(f.error, KVBridgeError) and f.direction == "send"
    time.sleep(0.2)
    assert not md.poll()  # the cancelled expect was reported once


# ---- bad arguments raise at once, nothing queued ------------------------------------------------
def test_bad_arguments_raise_in_the_callers_thread_with_nothing_queued(pair: Any) -> None:
    pre, md, _, _ = pair
    with stalled(md), stalled(pre):
        t = md.expect("r", list(range(8)), 0, 100)
        bad: list[tuple[type[BaseException], Callable[[], object]]] = [
            (InvalidArgument, lambda: md.expect("r", list(range(8)), 0, 100)),  # already expected
            (PageIndexError, lambda: md.expect("x", [0, 500], 0, 32)),  # outside the cache
            (LayoutError, lambda: md.expect("x", [0], 0, 10, layers=(0, 9))),
            (InvalidArgument, lambda: md.expect("x", [0], 0, 10, via="rdma")),
            (InvalidArgument, lambda: md.expect("x", [0], 0, 10, timeout=0)),
            (InvalidArgument, lambda: pre.send("r", list(range(7)), {"nowhere": t})),
            (KVBridgeError, lambda: pre.send("r", list(range(7)), {"md": b"junk"})),
            (InvalidArgument, lambda: pre.send("other", list(range(7)), {"md": t})),
            (PageIndexError, lambda: pre.send("r", [0, 1, 2, 3, 4, 5, 900], {"md": t})),
            (InvalidArgument, lambda: pre.send("r", list(range(7)), {})),
            (InvalidArgument, lambda: pre.send("r", list(range(7)), {"md": t}, lease=-1)),
            (InvalidArgument, lambda: pre.send("r", list(range(7)), {"md": t}, timeout=0)),
        ]
        for kind, call in bad:
            with pytest.raises(kind):
                call()
        assert pre.pending == ([], []) and md.pending == ([], ["r"])
        pre.send("r", list(range(7)), {"md": t}, layerwise=True)
        with pytest.raises(InvalidArgument, match="already"):
            pre.send("r", list(range(7)), {"md": t})
        with pytest.raises(InvalidArgument, match="outside"):
            pre.layers_ready("r", P.num_layers + 1)
        with pytest.raises(InvalidArgument):
            pre.layers_ready("r", 1.5)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            pre.renew_lease("r", float("inf"))
        assert pre.pending == (["r"], [])
        assert pre.layers_ready("r", P.num_layers) is True
    ev = Events(pre).until(lambda e: bool(e.released))
    assert [d.request_id for d in ev.sent] == ["r"] and not ev.failed
    assert [d.request_id for d in Events(md).until(lambda e: bool(e.received)).received] == ["r"]
    t2 = md.expect("s", list(range(60)), 0, 900)
    with stalled(pre):
        pre.send("s", list(range(60)), {"md": t2})
        with pytest.raises(InvalidArgument, match="layerwise"):  # a plain send is no layer-wise one
            pre.layers_ready("s", 1)
    Events(pre).until(lambda e: bool(e.released))


# ---- what only the loop finds: a typed failed outcome ----------------------------------------
def test_a_destination_the_loop_cannot_reach_is_a_failed_outcome() -> None:
    """With a resolver, a destination is connected by the loop thread after
    send() returned: a name no live entry carries is reported through poll()
    as UnknownPeer, once per destination, with the send released."""
    view = RegistryView(compat_hash=P.compat_hash)
    md = SyncBridge(pack.PagedKVCache.allocate(P, 16), identity="md",
                    tcp_listen=("127.0.0.1", 0)).start()  # fmt: skip
    pre = SyncBridge(
        pack.PagedKVCache.allocate(P, 16), identity="p", resolver=view,
        peer_defaults=PeerConfig("tcp", connect_timeout=2.0),
    ).start()  # fmt: skip
    try:
        ticket = md.expect("u", list(range(4)), 0, 50)
        with pytest.raises(InvalidArgument, match="request"):  # ticket checks stay synchronous
            pre.send("v", list(range(4)), {"md-9": ticket})
        pre.send("u", list(range(4)), {"md-9": ticket})
        ev = Events(pre).until(lambda e: bool(e.released))
        (f,) = ev.failed
        assert isinstance(f.error, UnknownPeer) and f.peer == "md-9" and f.direction == "send"
        assert ev.released == ["u"] and not ev.sent and pre.pending == ([], [])
    finally:
        pre.close()
        md.close()


# ---- deadlines -------------------------------------------------------------------------------
def test_deadlines_hold_for_queued_calls(pair: Any) -> None:
    """An expect nobody sends to fails with TransferTimeout at its deadline;
    a layer-wise send whose layers never become ready fails at its
    layer_timeout, at both ends."""
    pre, md, _, _ = pair
    md.expect("never", list(range(4)), 0, 50, timeout=0.5)
    (f,) = Events(md).until(lambda e: bool(e.failed), timeout=10).failed
    assert f.request_id == "never" and isinstance(f.error, TransferTimeout)
    t = md.expect("stuck", list(range(4)), 0, 50, timeout=30)
    pre.send("stuck", list(range(4)), {"md": t}, layerwise=True, layer_timeout=0.5)
    ev = Events(pre).until(lambda e: bool(e.released), timeout=10)
    (g,) = ev.failed
    assert g.request_id == "stuck" and isinstance(g.error, TransferTimeout)
    (h,) = Events(md).until(lambda e: bool(e.failed), timeout=10).failed
    assert h.request_id == "stuck" and isinstance(h.error, TransferTimeout)  # told by the sender
    assert "peer ended" in str(h.error)


# ---- close with work still queued -------------------------------------------------------------
def test_close_with_calls_still_queued_reports_each_once() -> None:
    pre, md, _, _ = _pair()
    try:
        t = md.expect("held", list(range(20)), 0, 300)
        with stalled(pre):
            pre.send("held", list(range(20)), {"md": t}, layerwise=True)
            pre.layers_ready("held", 1)
            ev = pre.close()  # waits for the stalled loop, then for the queue
        (f,) = ev.failed
        assert f.request_id == "held" and isinstance(f.error, BridgeClosed)
        assert ev.released == ["held"] and not ev.sent
        (g,) = Events(md).until(lambda e: bool(e.failed)).failed  # the peer was told
        assert g.request_id == "held" and isinstance(g.error, TransferAborted)
        with stalled(md):
            md.expect("queued", list(range(20)), 0, 300)
            ev_md = md.close()
        (h,) = ev_md.failed
        assert h.request_id == "queued" and isinstance(h.error, BridgeClosed)
    finally:
        pre.close()
        md.close()


# ---- exactly once, under concurrency ------------------------------------------------------------
def test_every_outcome_exactly_once_with_cancels_racing_sends() -> None:
    """Four engine threads expect and send; a fifth cancels random requests
    at random moments (before the loop picked them up, while they run, after
    they ended) and a sixth feeds layer-wise sends their layers.  Each
    expect has exactly one outcome, each destination of each send exactly
    one, each send one release; every cancel of a pending request returned
    True and one of an ended request False."""
    pre, md, src, dst = _pair()
    n_threads, per_thread, n = 4, 12, 200
    rids = [f"k{i}" for i in range(n_threads * per_thread)]
    started: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()
    rng = random.Random(7)
    got_p, got_md = Events(pre), Events(md)

    def engine(k: int) -> None:
        try:
            for j in range(per_thread):
                i = k * per_thread + j
                rid = rids[i]
                st = np.arange(P.pages_for(n)) + (i % 8) * 13
                mt = np.arange(P.pages_for(n)) + (i % 8) * 13
                ticket = md.expect(rid, mt, 0, n, timeout=30)
                pre.send(rid, st, {"md": ticket}, timeout=30, layerwise=i % 3 == 0)
                with lock:
                    started.append(rid)
                got_p.add(pre.poll())
                got_md.add(md.poll())
        except BaseException as e:
            errors.append(e)

    def canceller() -> None:
        try:
            while not stop.is_set():
                with lock:
                    pick = rng.choice(started) if started else None
                if pick is not None and rng.random() < 0.3:
                    pre.cancel(pick, "raced")
                time.sleep(0.001)
        except BaseException as e:
            errors.append(e)

    def feeder() -> None:
        try:
            while not stop.is_set():
                with lock:
                    lw = [r for r in started if int(r[1:]) % 3 == 0]
                for r in lw:
                    pre.layers_ready(r, P.num_layers)
                time.sleep(0.002)
        except BaseException as e:
            errors.append(e)

    side = [threading.Thread(target=canceller), threading.Thread(target=feeder)]
    engines = [threading.Thread(target=engine, args=(k,)) for k in range(n_threads)]
    try:
        for t in side + engines:
            t.start()
        for t in engines:
            t.join(60)
        ev_p = got_p.until(lambda e: len(e.released) == len(rids), timeout=60)
        stop.set()
        for t in side:
            t.join(10)
        assert not errors, errors
        ev_md = got_md.until(lambda e: len(e.received) + len(e.failed) == len(rids), timeout=60)
        time.sleep(0.3)
        got_p.add(pre.poll())
        got_md.add(md.poll())
        sends = Counter(d.request_id for d in ev_p.sent) + Counter(
            f.request_id for f in ev_p.failed
        )
        assert sends == dict.fromkeys(rids, 1)
        assert Counter(ev_p.released) == dict.fromkeys(rids, 1)
        recvs = Counter(d.request_id for d in ev_md.received) + Counter(
            f.request_id for f in ev_md.failed
        )
        assert recvs == dict.fromkeys(rids, 1)
        assert all(isinstance(f.error, Cancelled | TransferAborted) for f in ev_p.failed)
        assert pre.pending == ([], []) and md.pending == ([], [])
        assert pre.cancel(rids[0]) is False
        done = {d.request_id for d in ev_md.received}
        for rid in done & {d.request_id for d in ev_p.sent}:
            i = int(rid[1:])
            pages = np.arange(P.pages_for(n)) + (i % 8) * 13
            assert _same(src, pages, dst, pages, n)  # same pages both sides: same bytes
    finally:
        stop.set()
        pre.close()
        md.close()
