"""UCX between two and three processes on this machine, over TCP and over
shared memory: integrity, layer-wise sends, put and staging paths together,
and a peer killed mid-transfer giving a typed error within the deadline."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ucx_workers

from kvbridge.layout import KVLayout
from kvbridge.transport import ucx

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"),
]

# (UCX_TLS, error mode): TCP; TCP plus shared memory with peer error handling
# (puts emulated over TCP, notifications too); TCP plus CMA without peer error
# handling (puts by the kernel's process_vm_writev).
TRANSPORTS = [("tcp", "none"), ("tcp", "peer"), ("tcp,sm", "none"), ("tcp,sm", "peer")]
LAY = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, page_tokens=16)


class Proc:
    def __init__(
        self,
        tls: str,
        mode: str,
        layout: KVLayout,
        pages: int,
        seed: int | None,
        **opts: Any,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        env = {"UCX_TLS": tls}
        self.p = ctx.Process(
            target=ucx_workers.agent_main, args=(child, env, layout, pages, seed, mode, opts)
        )
        self.p.start()
        child.close()
        self.md = self.recv(30)[1]

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"no answer within {timeout} s")
        return self.conn.recv()

    def stop(self) -> None:
        if self.p.is_alive():
            try:
                self.conn.send(("quit",))
            except OSError:
                pass
            self.p.join(10)
        if self.p.is_alive():
            self.p.kill()
            self.p.join()
        self.conn.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for p in made:
        p.stop()


@pytest.mark.parametrize(("tls", "mode"), TRANSPORTS, ids=[f"{t}-{m}" for t, m in TRANSPORTS])
def test_two_processes_layerwise_put(procs: list[Proc], tls: str, mode: str) -> None:
    s = Proc(tls, mode, LAY, 64, seed=11)
    r = Proc(tls, mode, LAY, 80, seed=None)
    procs += [s, r]
    s.send("connect", r.md)
    assert s.recv(30) == ("ok", True)
    rng = np.random.default_rng(5)
    sbt, rbt = rng.permutation(64)[:40], np.arange(20, 60)
    r.send("expect", "req", rbt, 7, 630, None, 30.0)
    s.send("send", [(0, "req", sbt, rbt, 7, 630, [(0, 1), (1, 3), (3, 4)])])
    sent = s.recv(30)
    assert [x[0] for x in sent[1]] == ["ok"] * 3, sent
    got = r.recv(30)
    assert got[0] == "ok" and got[1] == "put", got
    s.send("digest", sbt, 7, 630, None)
    assert s.recv(30)[1] == got[-1]


def test_three_processes_put_and_staging(procs: list[Proc]) -> None:
    other = LAY.replace(page_tokens=32, order="page_first", head_order="HND")
    s = Proc("tcp", "peer", LAY, 64, seed=3)
    r1 = Proc("tcp", "peer", LAY, 64, seed=None)
    r2 = Proc("tcp", "peer", other, 32, seed=None)
    procs += [s, r1, r2]
    s.send("connect", r1.md)
    assert s.recv(30) == ("ok", True)
    s.send("connect", r2.md)
    assert s.recv(30) == ("ok", False)
    sbt = np.arange(64)[::-1].copy()
    bt1, bt2 = np.arange(64), np.arange(31, -1, -1)
    r1.send("expect", "q", bt1, 0, 1000, None, 30.0)
    r2.send("expect", "q", bt2, 0, 1000, None, 30.0)
    s.send(
        "send",
        [
            (0, "q", sbt, bt1, 0, 1000, [(0, 2), (2, 4)]),
            (1, "q", sbt, bt2, 0, 1000, [(0, 2), (2, 4)]),
        ],
    )
    assert [x[0] for x in s.recv(30)[1]] == ["ok"] * 4
    g1, g2 = r1.recv(30), r2.recv(30)
    assert (g1[1], g2[1]) == ("put", "staging")
    s.send("digest", sbt, 0, 1000, None)
    d = s.recv(30)[1]
    assert g1[-1] == d and g2[-1] == d


@pytest.mark.parametrize(("tls", "mode"), TRANSPORTS, ids=[f"{t}-{m}" for t, m in TRANSPORTS])
def test_sender_killed_mid_transfer(procs: list[Proc], tls: str, mode: str) -> None:
    s = Proc(tls, mode, LAY, 64, seed=1)
    r = Proc(tls, mode, LAY, 64, seed=None)
    procs += [s, r]
    s.send("connect", r.md)
    s.recv(30)
    bt = np.arange(64)
    r.send("expect", "k", bt, 0, 1024, None, 30.0)
    s.send("send", [(0, "k", bt, bt, 0, 1024, [(0, 1)])])  # one layer of four
    assert s.recv(30)[1][0][0] == "ok"
    time.sleep(0.2)
    killed = time.time()
    s.p.kill()
    got = r.recv(25)
    assert got[0] == "error" and "PeerGone" in got[4], got
    assert got[3] - killed < 6.0  # inside the 30 s deadline (heartbeat: 3 s at worst)
    print(f"sender death seen after {got[3] - killed:.2f} s: {got[2]}")


@pytest.mark.parametrize(("tls", "mode"), TRANSPORTS, ids=[f"{t}-{m}" for t, m in TRANSPORTS])
def test_receiver_killed_mid_transfer(procs: list[Proc], tls: str, mode: str) -> None:
    big = LAY.replace(num_kv_heads=8, head_dim=128)
    s = Proc(tls, mode, big, 512, seed=2)
    r = Proc(tls, mode, big, 512, seed=None)
    procs += [s, r]
    s.send("connect", r.md)
    s.recv(30)
    bt = np.arange(512)
    s.send("send_forever", "f", bt, bt, 0, 512 * 16)
    assert s.recv(30) == ("started",)
    time.sleep(0.3)
    killed = time.time()
    r.p.kill()
    got = s.recv(25)
    assert got[0] == "error" and "PeerGone" in got[4], got
    assert got[3] - killed < 6.0
    print(f"receiver death seen after {got[3] - killed:.2f} s: {got[2]}")


@pytest.mark.parametrize("tls", ["tcp", "tcp,sm"])
def test_receiver_killed_with_runs_waiting_for_the_put_window(procs: list[Proc], tls: str) -> None:
    """Scattered pages (a put per page) through a window of 2: when the
    receiver dies, the runs still waiting to be posted fail too."""
    s = Proc(tls, "none", LAY, 512, seed=3, put_window=2)
    r = Proc(tls, "none", LAY, 512, seed=None)
    procs += [s, r]
    s.send("connect", r.md)
    s.recv(30)
    bt = np.arange(512)
    rbt = np.random.default_rng(3).permutation(512)
    s.send("send_forever", "w", bt, rbt, 0, 512 * 16)
    assert s.recv(30) == ("started",)
    time.sleep(0.3)
    killed = time.time()
    r.p.kill()
    got = s.recv(25)
    assert got[0] == "error" and "PeerGone" in got[4], got
    assert got[3] - killed < 6.0


def test_a_blocked_receiver_loop_does_not_stall_the_sender(procs: list[Proc]) -> None:
    """Over TCP a put completes only when the receiver's worker answers its
    flush; the receiver's progress thread does that while its loop is busy."""
    s = Proc("tcp", "none", LAY, 16, seed=3)
    r = Proc("tcp", "none", LAY, 16, seed=None)
    procs += [s, r]
    s.send("connect", r.md)
    s.recv(30)
    bt = np.arange(4)
    r.send("expect_blocked", "b", bt, 0, 64, 2.0)
    assert r.recv(30) == ("blocking",)
    time.sleep(0.2)  # the receiver's loop is now blocked (and was polling)
    s.send("timed_send", "b", bt, bt, 0, 64)
    got = s.recv(30)
    assert got[0] == "ok", got
    assert got[2] < 1.0, got  # answered by the thread, not when the loop wakes at 2 s
    assert r.recv(30)[0] == "ok"
