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
def cli(*args: str) -> Iterator[tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.sim.emulator", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        host, port = json.loads(line)["listen"].rsplit(":", 1)
        yield host, int(port)
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


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
            "kvbridge.sim.emulator",
            "proxy",
            "--target",
            "x:1",
            "--rate",
            "fast",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=30,
        check=False,
    )
    assert out.returncode == 2 and "rate" in out.stderr
