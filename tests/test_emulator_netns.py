"""WanEmulator: the packet-level emulator (needs root, ip and /dev/net/tun).

RTT checks are correctness checks of the emulator: never faster than the
configured delay, with a loose upper bound.  Rate checks assert an upper
bound only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from kvbridge.errors import InvalidArgument, Unavailable
from kvbridge_bench.sim.emulator import LinkParams, WanEmulator
from kvbridge_bench.sim.emulator import netns as netns_mod

ROOT = Path(__file__).resolve().parents[1]
OK, WHY = WanEmulator.available()
F = TypeVar("F", bound=Callable[..., None])


def needs_netns(fn: F) -> F:
    marked: F = pytest.mark.netns(
        pytest.mark.skipif(not OK, reason=f"packet emulator unavailable: {WHY}")(fn)
    )
    return marked


def _ns_exists(name: str) -> bool:
    return netns_mod.namespace_exists(name)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


class Receiver:
    """A server socket in side B that accepts one connection and records it."""

    def __init__(self, emu: WanEmulator) -> None:
        self.srv = emu.socket("b")
        self.srv.bind((emu.addr_b, 0))
        self.srv.listen()
        self.srv.settimeout(10)
        self.port = self.srv.getsockname()[1]
        self.data = bytearray()
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            conn.settimeout(20)
            while chunk := conn.recv(1 << 20):
                self.times.append(time.monotonic())
                self.data.extend(chunk)

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.srv.close()


def _send(emu: WanEmulator, port: int, payload: bytes) -> None:
    with emu.socket("a") as cli:
        cli.settimeout(20)
        cli.connect((emu.addr_b, port))
        cli.sendall(payload)


def test_unavailable_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, why = WanEmulator.available()
    assert not ok and "root" in why
    with pytest.raises(Unavailable, match="root"):
        WanEmulator().start()


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgument):
        WanEmulator(mtu=100)
    with pytest.raises(InvalidArgument):
        WanEmulator(loss=2.0)
    with pytest.raises(InvalidArgument):
        WanEmulator(addr_a="10.0.0.1", addr_b="10.0.0.1")
    with pytest.raises(InvalidArgument):
        WanEmulator().namespace("c")
    with pytest.raises(InvalidArgument):
        WanEmulator().popen("a", ["true"])  # not started


@needs_netns
def test_namespaces_created_and_torn_down() -> None:
    with WanEmulator(rtt_ms=2, mtu=9000) as emu:
        names = (emu.ns_a, emu.ns_b)
        assert all(n.startswith("kvbemu") and _ns_exists(n) for n in names)
        out = emu.run("a", ["ip", "addr", "show", "kvbtun0"], capture_output=True, text=True)
        assert emu.addr_a in out.stdout and "mtu 9000" in out.stdout
        out = emu.run("b", ["ip", "addr", "show", "kvbtun0"], capture_output=True, text=True)
        assert emu.addr_b in out.stdout
        fwd = emu._fwd
        assert fwd is not None and fwd.poll() is None
    assert not any(_ns_exists(n) for n in names)
    assert fwd.poll() is not None


@needs_netns
def test_cleanup_on_interrupt_stops_processes() -> None:
    with pytest.raises(KeyboardInterrupt), WanEmulator(rtt_ms=2) as emu:
        names = (emu.ns_a, emu.ns_b)
        sleeper = emu.popen("b", ["sleep", "60"])
        raise KeyboardInterrupt
    assert sleeper.poll() is not None
    assert not any(_ns_exists(n) for n in names)


@needs_netns
def test_cleanup_stale_removes_only_dead_owners() -> None:
    dead = f"{netns_mod.NS_PREFIX}4194303x0000aa"  # above any live pid here
    subprocess.run(["ip", "netns", "add", dead + "a"], check=True)
    with WanEmulator(rtt_ms=2) as emu:
        removed = WanEmulator.cleanup_stale()
        assert dead + "a" in removed
        assert emu.ns_a not in removed and _ns_exists(emu.ns_a)
    assert not _ns_exists(dead + "a")


@needs_netns
def test_connect_and_ping_pong_see_the_rtt() -> None:
    rtt = 0.030
    with WanEmulator(rate_bps=1e9, rtt_ms=rtt * 1000) as emu:
        srv = emu.socket("b")
        srv.bind((emu.addr_b, 0))
        srv.listen()
        srv.settimeout(10)
        cli = emu.socket("a")
        cli.settimeout(10)
        t0 = time.monotonic()
        cli.connect(srv.getsockname())
        connect_s = time.monotonic() - t0
        conn, _ = srv.accept()
        conn.settimeout(10)

        def echo() -> None:
            while data := conn.recv(64):
                conn.sendall(data)

        th = threading.Thread(target=echo, daemon=True)
        th.start()
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(7):
            t0 = time.monotonic()
            cli.sendall(b"x")
            assert cli.recv(1) == b"x"
            rtts.append(time.monotonic() - t0)
        cli.close()
        th.join(10)
        conn.close()
        srv.close()
    assert connect_s >= rtt - 0.001
    assert min(rtts) >= rtt - 0.001
    assert statistics.median(rtts) < rtt + 0.050  # loose: the machine is shared


@needs_netns
def test_rate_bound_queue_bound_and_integrity() -> None:
    rate, queue = 40e6, 30_000
    payload = os.urandom(1_500_000)
    with WanEmulator(rate_bps=rate, rtt_ms=10, queue_bytes=queue, mtu=1500) as emu:
        rx = Receiver(emu)
        _send(emu, rx.port, payload)
        rx.join()
        st = emu.stats()["ab"]
    assert hashlib.sha256(rx.data).digest() == hashlib.sha256(payload).digest()
    elapsed = rx.times[-1] - rx.times[0]
    # bytes (TCP payload) delivered after the first read cannot beat the line
    assert len(payload) - len(rx.data[:65536]) <= rate / 8 * elapsed + queue + 2 * 1500
    assert st["max_queue_bytes"] <= queue
    assert st["bytes_out"] >= len(payload)


@needs_netns
def test_loss_drops_packets_tcp_recovers() -> None:
    payload = os.urandom(2_000_000)
    with WanEmulator(rate_bps=200e6, rtt_ms=6, loss=0.02, seed=11, mtu=1500) as emu:
        before = emu.tcp_counters("a")["RetransSegs"]
        rx = Receiver(emu)
        _send(emu, rx.port, payload)
        rx.join()
        stats = emu.stats()
        retrans = emu.tcp_counters("a")["RetransSegs"] - before
    assert bytes(rx.data) == payload
    assert stats["ab"]["dropped_loss"] > 0
    assert retrans > 0  # the sender's kernel saw the loss and retransmitted


@needs_netns
def test_set_link_changes_delay_at_runtime() -> None:
    with WanEmulator(rate_bps=1e9, rtt_ms=2) as emu:
        emu.set_link(LinkParams(rate_bps=1e9, delay_s=0.040), LinkParams(rate_bps=1e9, delay_s=0.0))
        srv = emu.socket("b")
        srv.bind((emu.addr_b, 0))
        srv.listen()
        cli = emu.socket("a")
        cli.settimeout(10)
        t0 = time.monotonic()
        cli.connect(srv.getsockname())
        elapsed = time.monotonic() - t0
        cli.close()
        srv.close()
    assert elapsed >= 0.040 - 0.001


@needs_netns
def test_popen_run_and_sysctl() -> None:
    server = (
        "import socket,sys\n"
        "s=socket.create_server((sys.argv[1],0));print(s.getsockname()[1],flush=True)\n"
        "c,_=s.accept();c.sendall(c.recv(100).upper());c.close()\n"
    )
    client = (
        "import socket,sys\n"
        "c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=10)\n"
        "c.sendall(b'hello');print(c.recv(100).decode())\n"
    )
    with WanEmulator(rtt_ms=4) as emu:
        srv = emu.popen(
            "b", [sys.executable, "-c", server, emu.addr_b], stdout=subprocess.PIPE, text=True
        )
        assert srv.stdout is not None
        port = srv.stdout.readline().strip()
        out = emu.run(
            "a", [sys.executable, "-c", client, emu.addr_b, port], capture_output=True, text=True
        )
        assert out.returncode == 0 and out.stdout.strip() == "HELLO"
        assert srv.wait(10) == 0
        srv.stdout.close()
        emu.sysctl("a", "net.ipv4.tcp_rmem", "4096 131072 12345678")
        got = emu.read_proc("a", "sys/net/ipv4/tcp_rmem").split()
        assert got == ["4096", "131072", "12345678"]
        assert emu.read_proc("b", "sys/net/ipv4/tcp_rmem").split() != got  # per namespace


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kvbench")]))
    return subprocess.run(
        [sys.executable, "-m", "kvbridge_bench.sim.emulator", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@needs_netns
def test_cli_check_run_and_cleanup() -> None:
    out = _cli("check")
    assert out.returncode == 0 and json.loads(out.stdout)["available"] is True
    server = (
        "import socket,os\n"
        "s=socket.create_server((os.environ['KVB_ADDR_B'],7001))\n"
        "c,_=s.accept();c.sendall(c.recv(100)[::-1]);c.close()\n"
    )
    client = (
        "import socket,sys,time\n"
        "t=time.monotonic();c=socket.create_connection((sys.argv[1],7001),timeout=10)\n"
        "rtt=time.monotonic()-t;c.sendall(b'abc');print(c.recv(100).decode(),rtt>=0.019)\n"
    )
    out = _cli(
        "run", "--rate", "100mbit", "--rtt", "20ms", "--stats", "--",
        sys.executable, "-c", client, "{addr_b}", ":::", sys.executable, "-c", server,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cba", "True"]
    stats = json.loads(out.stderr.strip().splitlines()[-1])
    assert stats["ab"]["packets_out"] > 0
    out = _cli("run", "--rtt", "1ms", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert out.returncode == 3
    out = _cli("cleanup")
    assert out.returncode == 0 and "deleted" in json.loads(out.stdout)


@contextlib.contextmanager
def _emulator_cli(*args: str) -> Iterator[subprocess.Popen[str]]:
    """The emulator's command line in a child (stdout piped); killed if still up."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kvbench")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_bench.sim.emulator", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@needs_netns
def test_cli_up_tears_down_on_sigterm() -> None:
    with _emulator_cli("up", "--rtt", "5ms") as proc:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert _ns_exists(info["ns_a"]) and _ns_exists(info["ns_b"])
        proc.terminate()  # at once: the signal may land before the wait loop
        proc.send_signal(signal.SIGINT)  # a second signal must not cut teardown short
        assert proc.wait(20) == 0
        assert not _ns_exists(info["ns_a"]) and not _ns_exists(info["ns_b"])


@needs_netns
def test_cli_run_stopped_while_starting_tears_down() -> None:
    """SIGTERM during side B's head start: status 130 and nothing left behind."""
    side_b = "import time; print('b up', flush=True); time.sleep(60)"
    with _emulator_cli(
        "run", "--rtt", "1ms", "--stagger", "30s", "--", "true", ":::", sys.executable, "-c", side_b
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "b up"
        proc.terminate()
        assert proc.wait(20) == 130
        mine = f"kvbemu{proc.pid}x"
        assert not [n for n in netns_mod.stale_namespaces(include_live=True) if n.startswith(mine)]


@needs_netns
@pytest.mark.parametrize("use_uvloop", [False, True])
def test_asyncio_endpoints_on_both_sides(use_uvloop: bool) -> None:
    uvloop = pytest.importorskip("uvloop") if use_uvloop else None
    payload = os.urandom(3_000_000)

    async def main(emu: WanEmulator) -> bytes:
        got = bytearray()
        done = asyncio.Event()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            got.extend(await r.read(-1))
            w.write(hashlib.sha256(got).digest())
            await w.drain()
            w.close()
            await w.wait_closed()
            done.set()

        lsock = emu.socket("b")
        lsock.bind((emu.addr_b, 0))
        server = await asyncio.start_server(handle, sock=lsock)
        csock = emu.socket("a")
        csock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(csock, lsock.getsockname())
        r, w = await asyncio.open_connection(sock=csock)
        w.write(payload)
        await w.drain()
        w.write_eof()
        digest = await r.read(-1)
        w.close()
        await w.wait_closed()
        await asyncio.wait_for(done.wait(), 10)
        server.close()
        await server.wait_closed()
        return digest

    with WanEmulator(rate_bps=2e8, rtt_ms=10) as emu:
        coro = asyncio.wait_for(main(emu), 30)
        digest = uvloop.run(coro) if uvloop is not None else asyncio.run(coro)
    assert digest == hashlib.sha256(payload).digest()


@needs_netns
def test_owner_killed_leaves_namespaces_that_cleanup_stale_removes() -> None:
    script = (
        "import json,time\n"
        "from kvbridge_bench.sim.emulator import WanEmulator\n"
        "e=WanEmulator(rtt_ms=2).start()\n"
        "print(json.dumps([e.ns_a,e.ns_b,e._fwd.pid]),flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kvbench")])),
    )
    assert owner.stdout is not None
    ns_a, ns_b, fwd_pid = json.loads(owner.stdout.readline())
    owner.kill()
    owner.wait(10)
    owner.stdout.close()
    assert _ns_exists(ns_a) and _ns_exists(ns_b)
    for _ in range(200):  # the forwarder notices its owner is gone (stdin EOF)
        if _gone(fwd_pid):
            break
        time.sleep(0.02)
    else:
        pytest.fail("the forwarder outlived its owner")
    removed = WanEmulator.cleanup_stale()
    assert ns_a in removed and ns_b in removed
    assert not _ns_exists(ns_a) and not _ns_exists(ns_b)
