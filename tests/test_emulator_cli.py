"""The emulator's command line in proxy and fault modes (no root needed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def echo_server() -> Iterator[int]:
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    while data := conn.recv(65536):
                        conn.sendall(data)
                except OSError:
                    pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        th.join(10)
        srv.close()


@contextmanager
def cli_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """The emulator's command line, its listening address read; killed and
    reaped at the end if it is still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge_bench.sim.emulator", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kvbench")])),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        host, port = json.loads(line)["listen"].rsplit(":", 1)
        yield proc, host, int(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


@contextmanager
def cli(*args: str) -> Iterator[tuple[str, int]]:
    """As :func:`cli_process`; at the end SIGTERM must stop it with status 0."""
    with cli_process(*args) as (proc, host, port):
        yield host, port
        proc.terminate()
        assert proc.wait(10) == 0


def test_cli_proxy_delays_and_forwards() -> None:
    with (
        echo_server() as port,
        cli("proxy", "--target", f"127.0.0.1:{port}", "--rtt", "50ms", "--rate", "100mbit") as a,
        socket.create_connection(a, timeout=10) as c,
    ):
        t0 = time.monotonic()
        c.sendall(b"ping")
        got = b""
        while len(got) < 4:
            got += c.recv(4)
        assert got == b"ping"
        assert time.monotonic() - t0 >= 0.050 - 0.002


def test_cli_faults_reset_after() -> None:
    with (
        echo_server() as port,
        cli("faults", "--target", f"127.0.0.1:{port}", "--reset-after", "1000", "--conn", "0") as a,
    ):
        with socket.create_connection(a, timeout=10) as c:
            c.sendall(os.urandom(1000))
            got = 0
            with pytest.raises(ConnectionResetError):
                while True:
                    data = c.recv(65536)
                    if not data:
                        break
                    got += len(data)
            assert got <= 1000
        with socket.create_connection(a, timeout=10) as c:  # the second is untouched
            c.sendall(b"x" * 5000)
            got = 0
            while got < 5000:
                got += len(c.recv(65536))


def test_cli_rejects_bad_values() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge_bench.sim.emulator",
            "proxy",
            "--target",
            "x:1",
            "--rate",
            "fast",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "kvbench")])),
        timeout=30,
        check=False,
    )
    assert out.returncode == 2 and "rate" in out.stderr


@pytest.mark.parametrize("mode", ["proxy", "faults"])
def test_cli_stops_cleanly_on_sigterm_during_traffic(mode: str) -> None:
    """A signal that lands while bytes flow through both directions (any
    callback of the loop may be running) still ends the proxy with status 0
    within its bounded teardown, the connections cut."""
    extra = ["--rtt", "1ms"] if mode == "proxy" else []
    for _ in range(5):
        with (
            echo_server() as port,
            cli_process(mode, "--target", f"127.0.0.1:{port}", *extra) as (proc, host, p),
        ):
            conns = [socket.create_connection((host, p), timeout=10) for _ in range(3)]
            stop = threading.Event()

            def pump(c: socket.socket, stop: threading.Event) -> None:
                chunk = os.urandom(65536)
                try:
                    while not stop.is_set():
                        c.sendall(chunk)
                        c.recv(1 << 20)
                except OSError:
                    pass

            threads = [threading.Thread(target=pump, args=(c, stop), daemon=True) for c in conns]
            for t in threads:
                t.start()
            time.sleep(0.2)
            proc.send_signal(15)
            assert proc.wait(10) == 0, proc.stderr.read() if proc.stderr else ""
            stop.set()
            for c in conns:
                c.close()
            for t in threads:
                t.join(10)
