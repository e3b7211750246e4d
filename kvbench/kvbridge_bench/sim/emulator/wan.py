"""WanEmulator: two network namespaces joined by an emulated WAN line.

    with WanEmulator(rate_bps=1e9, rtt_ms=40, loss=0.001) as emu:
        server = emu.popen("b", ["python", "-m", "my.server", "--host", emu.addr_b])
        emu.run("a", ["python", "-m", "my.client", emu.addr_b])

The kernels of both namespaces run real TCP across the line, so they see its
round trip, its rate, its queue and its losses.  Processes run inside a side
with :meth:`popen` / :meth:`run`; :meth:`socket` creates a socket inside a
side from this very process (it stays there), so one asyncio program can hold
a client on side A and a server on side B.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import kvbridge
from kvbridge.errors import InvalidArgument, KVBridgeError, KVBridgeTimeout

from . import netns
from .params import LinkParams

T = TypeVar("T")

# the folders that hold kvbridge_bench and kvbridge, for the forwarder's interpreter
_PKG_ROOT = str(Path(__file__).resolve().parents[3])
_LIB_ROOT = str(Path(kvbridge.__file__).resolve().parents[1])


def _side(side: str) -> int:
    s = str(side).lower()
    if s not in ("a", "b"):
        raise InvalidArgument(f"side must be 'a' or 'b', got {side!r}")
    return 0 if s == "a" else 1


def _stop_process(proc: subprocess.Popen[Any], grace_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


class WanEmulator:
    """A packet-level emulated WAN line between namespace A and namespace B.

    ``rate_bps``, ``rtt_ms`` (split evenly into two one-way delays),
    ``jitter_ms``, ``loss``, ``queue_bytes`` and ``reorder`` set both
    directions; ``a_to_b`` / ``b_to_a`` replace them for one direction.
    ``mtu`` is the TUN devices' MTU (the default 65000 keeps the packet rate,
    and so the forwarder's CPU cost, low).  ``seed`` makes loss and jitter
    reproducible.  ``sysctls`` are set in both namespaces (for example
    ``{"net.ipv4.tcp_rmem": "4096 131072 33554432"}``).
    """

    def __init__(
        self,
        rate_bps: float = 1e9,
        rtt_ms: float = 40.0,
        *,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        queue_bytes: int | None = None,
        reorder: bool = False,
        mtu: int = 65000,
        seed: int | None = None,
        a_to_b: LinkParams | None = None,
        b_to_a: LinkParams | None = None,
        addr_a: str = "10.203.0.1",
        addr_b: str = "10.203.0.2",
        sysctls: dict[str, str] | None = None,
        start_timeout_s: float = 15.0,
    ) -> None:
        if not rtt_ms >= 0:
            raise InvalidArgument(f"rtt_ms must be >= 0, got {rtt_ms!r}")
        both = LinkParams(
            rate_bps=float(rate_bps),
            delay_s=rtt_ms / 2000.0,
            jitter_s=jitter_ms / 1000.0,
            loss=float(loss),
            queue_bytes=queue_bytes,
            reorder=reorder,
        )
        self.a_to_b = a_to_b or both
        self.b_to_a = b_to_a or both
        if not 576 <= mtu <= 65535:
            raise InvalidArgument(f"mtu must be within [576, 65535], got {mtu}")
        if addr_a == addr_b:
            raise InvalidArgument("addr_a and addr_b must differ")
        self.mtu = mtu
        self.seed = seed
        self.addr_a, self.addr_b = addr_a, addr_b
        self.sysctls = dict(sysctls or {})
        self.start_timeout_s = start_timeout_s
        self.ns_a, self.ns_b = netns.new_names()
        self._fwd: subprocess.Popen[bytes] | None = None
        self._fwd_buf = b""
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    # --- capability --------------------------------------------------------
    @staticmethod
    def available() -> tuple[bool, str]:
        """``(True, "ok")`` or ``(False, why)``: root, ``ip`` and ``/dev/net/tun``."""
        return netns.available()

    @staticmethod
    def cleanup_stale(include_live: bool = False) -> list[str]:
        """Delete namespaces left behind by emulators whose process died."""
        return netns.cleanup_stale(include_live)

    # --- lifecycle ---------------------------------------------------------
    @property
    def rtt_s(self) -> float:
        return self.a_to_b.delay_s + self.b_to_a.delay_s

    def start(self) -> WanEmulator:
        if self._started:
            raise InvalidArgument("this WanEmulator was already started")
        netns.require_available()
        self._started = True
        atexit.register(self.close)  # also covers an owner that never reaches close()
        try:
            netns.create_side(self.ns_a, self.addr_a, self.addr_b, self.mtu)
            netns.create_side(self.ns_b, self.addr_b, self.addr_a, self.mtu)
            for key, value in self.sysctls.items():
                for ns in (self.ns_a, self.ns_b):
                    self._sysctl(ns, key, value)
            self._start_forwarder()
        except BaseException:
            self.close()
            raise
        return self

    def _start_forwarder(self) -> None:
        fd_a = netns.open_tun(self.ns_a)
        try:
            fd_b = netns.open_tun(self.ns_b)
        except BaseException:
            os.close(fd_a)
            raise
        cfg = {
            "fd_a": fd_a,
            "fd_b": fd_b,
            "mtu": self.mtu,
            "rtt_s": self.rtt_s,
            "seed": self.seed,
            "ab": self.a_to_b.to_dict(),
            "ba": self.b_to_a.to_dict(),
        }
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PKG_ROOT, _LIB_ROOT, env.get("PYTHONPATH", "")) if p
        )
        try:
            self._fwd = subprocess.Popen(
                [sys.executable, "-m", "kvbridge_bench.sim.emulator.forwarder", json.dumps(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(fd_a, fd_b),
                start_new_session=True,  # a terminal Ctrl-C reaches the owner, which tears down
                env=env,
            )
        finally:
            os.close(fd_a)
            os.close(fd_b)
        reply = self._read_reply(self.start_timeout_s)
        if not reply.get("ready"):
            raise KVBridgeError(f"forwarder did not start: {reply}")

    def _read_reply(self, timeout_s: float) -> dict[str, Any]:
        fwd = self._fwd
        if fwd is None or fwd.stdout is None:
            raise KVBridgeError("the forwarder is not running")
        fd = fwd.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._fwd_buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVBridgeTimeout(f"no answer from the forwarder within {timeout_s} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise KVBridgeError(f"the forwarder exited (code {fwd.poll()})")
                self._fwd_buf += chunk
        line, self._fwd_buf = self._fwd_buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _command(self, cmd: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
        with self._lock:
            fwd = self._fwd
            if fwd is None or fwd.stdin is None or fwd.poll() is not None:
                raise KVBridgeError("the forwarder is not running")
            fwd.stdin.write(json.dumps(cmd).encode() + b"\n")
            fwd.stdin.flush()
            reply = self._read_reply(timeout_s)
        if "error" in reply:
            raise KVBridgeError(f"forwarder: {reply['error']}")
        return reply

    def close(self, grace_s: float = 2.0) -> None:
        """Stop every process started here, the forwarder, and both namespaces.
        Safe to call twice and from ``atexit``."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            for proc in list(self._procs):
                _stop_process(proc, grace_s)
        finally:
            try:
                self._stop_forwarder(grace_s)
            finally:
                for ns in (self.ns_a, self.ns_b):
                    netns.delete_namespace(ns, grace_s)

    def _stop_forwarder(self, grace_s: float) -> None:
        fwd = self._fwd
        if fwd is None:
            return
        self._fwd = None
        with contextlib.suppress(OSError):
            if fwd.stdin is not None:
                fwd.stdin.close()
        try:
            fwd.wait(grace_s)
        except subprocess.TimeoutExpired:
            _stop_process(fwd, grace_s)
        if fwd.stdout is not None:
            fwd.stdout.close()

    def __enter__(self) -> WanEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the two sides -------------------------------------------------------
    def namespace(self, side: str) -> str:
        return (self.ns_a, self.ns_b)[_side(side)]

    def addr(self, side: str) -> str:
        """The address of ``side`` (reachable from the other side)."""
        return (self.addr_a, self.addr_b)[_side(side)]

    def exec_prefix(self, side: str) -> list[str]:
        """The argv prefix that runs a command inside ``side``."""
        return ["ip", "netns", "exec", self.namespace(side)]

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise InvalidArgument("the emulator is not running (use it as a context manager)")

    def popen(self, side: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``side``; it is stopped when the emulator closes."""
        self._check_running()
        if not argv:
            raise InvalidArgument("argv is empty")
        proc: subprocess.Popen[Any] = subprocess.Popen(
            [*self.exec_prefix(side), *map(str, argv)], **kwargs
        )
        self._procs.append(proc)
        return proc

    def run(
        self, side: str, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside ``side`` to completion (``subprocess.run`` semantics)."""
        self._check_running()
        if not argv:
            raise InvalidArgument("argv is empty")
        try:
            return subprocess.run(
                [*self.exec_prefix(side), *map(str, argv)], timeout=timeout, **kwargs
            )
        except subprocess.TimeoutExpired as exc:
            raise KVBridgeTimeout(f"{list(argv)!r} in side {side} ran past {timeout} s") from exc

    def call(self, side: str, fn: Callable[[], T]) -> T:
        """Call ``fn`` on a thread inside ``side`` (for creating sockets there)."""
        self._check_running()
        return netns.call_in_namespace(self.namespace(side), fn)

    def socket(
        self,
        side: str,
        family: int = socket.AF_INET,
        type: int = socket.SOCK_STREAM,
    ) -> socket.socket:
        """A new socket that lives in ``side``'s namespace."""
        return self.call(side, lambda: socket.socket(family, type))

    def _sysctl(self, ns: str, key: str, value: str) -> None:
        path = "/proc/sys/" + key.replace(".", "/")
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, "sh", "-c", 'printf "%s" "$1" > "$2"', "sh", value, path],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if proc.returncode != 0:
            raise InvalidArgument(f"cannot set {key}={value!r}: {proc.stderr.strip()}")

    def sysctl(self, side: str, key: str, value: str) -> None:
        """Set a per-namespace sysctl (``net.ipv4.tcp_rmem``...) in ``side``."""
        self._check_running()
        self._sysctl(self.namespace(side), key, value)

    def read_proc(self, side: str, rel: str) -> str:
        """Read ``/proc/<rel>`` as seen from ``side`` (``net/snmp``, ``net/netstat``)."""
        self._check_running()
        out: str = self.run(side, ["cat", f"/proc/{rel}"], capture_output=True, text=True).stdout
        return out

    def tcp_counters(self, side: str) -> dict[str, int]:
        """The ``Tcp:`` counters of ``/proc/net/snmp`` in ``side`` (RetransSegs...)."""
        lines = [ln.split() for ln in self.read_proc(side, "net/snmp").splitlines()]
        rows = [ln for ln in lines if ln and ln[0] == "Tcp:"]
        if len(rows) < 2:
            raise KVBridgeError("no Tcp: rows in /proc/net/snmp")
        return {k: int(v) for k, v in zip(rows[0][1:], rows[1][1:], strict=True)}

    # --- the line ------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per direction (``ab``, ``ba``): packets and bytes in and
        out, drops by loss and by queue, the largest queue seen, held packets."""
        self._check_running()
        reply = self._command({"op": "stats"})
        return {"ab": reply["ab"], "ba": reply["ba"]}

    def set_link(self, a_to_b: LinkParams | None = None, b_to_a: LinkParams | None = None) -> None:
        """Change the line's parameters while it runs."""
        self._check_running()
        cmd: dict[str, Any] = {"op": "set"}
        if a_to_b is not None:
            cmd["ab"] = a_to_b.to_dict()
            self.a_to_b = a_to_b
        if b_to_a is not None:
            cmd["ba"] = b_to_a.to_dict()
            self.b_to_a = b_to_a
        self._command(cmd)
