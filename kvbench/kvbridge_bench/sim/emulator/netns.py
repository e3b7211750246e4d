"""Network namespaces and TUN devices for the packet-level emulator.

Each emulator owns two namespaces named ``kvbemu<pid>x<hex>a`` and ``...b``
(the pid is the owner's, so :func:`cleanup_stale` can tell leftovers of dead
owners from live ones).  Each namespace holds a persistent TUN device
``kvbtun0`` with a point-to-point address towards the other side.  The
forwarder attaches to both devices; whatever the kernel of one namespace
routes to the peer address comes out of its TUN and is written into the
other's.

Everything here needs root.  :func:`available` says whether it can work.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import secrets
import shutil
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvbridge.errors import InvalidArgument, KVBridgeError, Unavailable

T = TypeVar("T")

NS_PREFIX = "kvbemu"
TUN_NAME = "kvbtun0"
NETNS_DIR = "/run/netns"

_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)x([0-9a-f]+)([ab])$")

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def available() -> tuple[bool, str]:
    """Whether the packet-level emulator can run here, and why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "needs root (network namespaces and TUN devices); use ProxyEmulator"
    if shutil.which("ip") is None:
        return False, "the `ip` command (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return False, "/dev/net/tun does not exist (no TUN support)"
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as exc:
        return False, f"cannot open /dev/net/tun: {exc.strerror}"
    if not os.path.exists("/proc/self/ns/net"):
        return False, "the kernel has no network namespaces"
    return True, "ok"


def require_available() -> None:
    ok, reason = available()
    if not ok:
        raise Unavailable(f"packet-level WAN emulator unavailable: {reason}")


def new_names() -> tuple[str, str]:
    """Fresh namespace names for side A and side B."""
    tag = f"{NS_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
    return tag + "a", tag + "b"


def ip(*args: str, timeout: float = 10.0, check: bool = True) -> str:
    """Run ``ip ARGS``; raise KVBridgeError with its stderr when it fails."""
    try:
        proc = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise KVBridgeError(f"`ip {' '.join(args)}` timed out after {timeout} s") from exc
    if check and proc.returncode != 0:
        raise KVBridgeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def namespace_exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def create_side(ns: str, local: str, peer: str, mtu: int) -> None:
    """Create namespace ``ns`` with loopback up and a TUN device addressed
    ``local`` whose point-to-point peer is ``peer``."""
    if not 576 <= mtu <= 65535:
        raise InvalidArgument(f"mtu must be within [576, 65535], got {mtu}")
    ip("netns", "add", ns)
    ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", ns, "tuntap", "add", "dev", TUN_NAME, "mode", "tun")
    ip("-n", ns, "link", "set", "dev", TUN_NAME, "mtu", str(mtu), "up")
    ip("-n", ns, "addr", "add", local, "peer", f"{peer}/32", "dev", TUN_NAME)


def call_in_namespace(ns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a short-lived thread that has entered namespace ``ns``.

    Sockets and TUN file descriptors created by ``fn`` stay in ``ns`` after it
    returns, so one process can hold endpoints on both sides of the line.
    """
    path = os.path.join(NETNS_DIR, ns)
    if not os.path.exists(path):
        raise InvalidArgument(f"network namespace {ns!r} does not exist")
    box: dict[str, object] = {}

    def body() -> None:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(path, os.O_RDONLY)
        try:
            _setns(target)
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc
            finally:
                _setns(home)
        except BaseException as exc:
            box.setdefault("error", exc)
        finally:
            os.close(home)
            os.close(target)

    thread = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        err = box["error"]
        assert isinstance(err, BaseException)
        raise err
    return box["value"]  # type: ignore[return-value]


def open_tun(ns: str, name: str = TUN_NAME) -> int:
    """Attach to the TUN device ``name`` of namespace ``ns``; a non-blocking fd
    that reads and writes raw IP packets (no packet-info header)."""

    def attach() -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            ifr = struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI)
            fcntl.ioctl(fd, TUNSETIFF, ifr)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return call_in_namespace(ns, attach)


def namespace_pids(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def delete_namespace(ns: str, grace_s: float = 2.0) -> None:
    """Stop the processes left in ``ns`` (all started by its owner), then delete it."""
    if not namespace_exists(ns):
        return
    pids = namespace_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            if pids:
                time.sleep(0.02)
        if not pids:
            break
    ip("netns", "del", ns, check=False)


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces(include_live: bool = False) -> list[str]:
    """Emulator namespaces whose owning process is gone (or all of them)."""
    if not os.path.isdir(NETNS_DIR):
        return []
    out = []
    for name in sorted(os.listdir(NETNS_DIR)):
        m = _NS_RE.match(name)
        if m is None:
            continue
        if include_live or not _owner_alive(int(m.group(1))):
            out.append(name)
    return out


def cleanup_stale(include_live: bool = False) -> list[str]:
    """Delete leftover emulator namespaces (and the processes in them); return
    their names.  Only names of the ``kvbemu<pid>x<hex>[ab]`` form are touched."""
    names = stale_namespaces(include_live)
    for name in names:
        delete_namespace(name)
    return names
