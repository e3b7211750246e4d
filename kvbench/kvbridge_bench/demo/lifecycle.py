"""The demo's process lifecycle: no role process outlives the driver.

- A role asks the kernel for a signal when its parent dies
  (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, Linux) and exits at once if the
  parent is already gone (:func:`die_with_parent`), so a driver killed with
  SIGKILL takes its roles with it.
- A role stops promptly on SIGTERM / SIGINT, even while its engine's worker
  thread is inside a forward pass (:func:`exit_on_signal`): the signal sets
  its stop event and arms a hard exit ``grace_s`` later, so a stuck teardown
  cannot keep it alive.
- The driver turns SIGTERM / SIGINT into the cancellation of its main task
  (:func:`cancel_on_signal`), so its ``finally`` stops the roles, the WAN
  emulator's forwarder and the network namespaces; :func:`stop_processes`
  ends the roles with SIGTERM, then SIGKILL, each wait bounded.
- A janitor process (:func:`start_janitor`, ``python -m
  kvbridge_bench.demo.lifecycle NS...``) holds a pipe from the driver and deletes
  the WAN emulator's network namespaces when the pipe closes: when the
  driver exits, however it exits.  (The emulator's forwarder already ends at
  the end of its stdin.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "PARENT_ENV",
    "cancel_on_signal",
    "child_env",
    "die_with_parent",
    "exit_on_signal",
    "start_janitor",
    "stop_janitor",
    "stop_processes",
]

PARENT_ENV = "KVBRIDGE_DEMO_PARENT"  # the driver's pid, checked by each role at start
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with this process named as the parent."""
    out = dict(os.environ if env is None else env)
    out[PARENT_ENV] = str(os.getpid())
    return out


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent thread
    exits (Linux); exit now if the parent named in ``KVBRIDGE_DEMO_PARENT``
    is already gone (it died before the request took effect).  False where
    the platform has no ``prctl``."""
    ok = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    want = os.environ.get(PARENT_ENV)
    if want is not None and want.isdigit() and os.getppid() != int(want):
        os._exit(128 + int(sig))
    return ok


def exit_on_signal(
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[], None],
    *,
    grace_s: float = 2.0,
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """On the first of ``signals``: call ``stop()`` on ``loop`` and exit the
    process (``os._exit``) ``grace_s`` later unless it exited by itself; a
    second signal exits at once."""
    fired: list[int] = []

    def hard_exit(code: int) -> None:
        sys.stderr.flush()
        os._exit(code)

    def on_signal(signum: int) -> None:
        if fired:
            hard_exit(128 + signum)
        fired.append(signum)
        timer = threading.Timer(grace_s, hard_exit, (128 + signum,))
        timer.daemon = True
        timer.start()
        stop()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)


@contextlib.contextmanager
def cancel_on_signal(
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
) -> Iterator[list[int]]:
    """Within an async function: SIGTERM / SIGINT cancel the current task
    (its ``finally`` blocks run); yields the list of signals received."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    got: list[int] = []
    installed: list[int] = []

    def on_signal(signum: int) -> None:
        got.append(signum)
        if task is not None and len(got) == 1:
            task.cancel()

    for sig in signals:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError) as e:
            # Only the main thread of the main interpreter may handle signals (a
            # driver run from a test's worker thread, say): there the caller's
            # own cancellation is the only way in, and the roles' parent-death
            # signal still stops them; said once, not silently skipped.
            log.debug("signal %s not handled by the demo driver here: %s", sig, e)
    try:
        yield got
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
            if sig == signal.SIGINT:  # remove_signal_handler leaves SIG_DFL: restore Python's
                signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_processes(procs: Sequence[subprocess.Popen[Any]], grace_s: float = 5.0) -> None:
    """Wait up to ``grace_s`` for ``procs`` to exit, then SIGTERM them, wait
    ``grace_s`` more, then SIGKILL what is left (every wait bounded)."""
    deadline = time.monotonic() + grace_s
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(sig)
            deadline = time.monotonic() + grace_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs):
            return


def start_janitor(namespaces: Sequence[str]) -> subprocess.Popen[bytes]:
    """A process that deletes ``namespaces`` (and what runs in them) once
    this process's end of its stdin closes; in its own session, so that a
    terminal's Ctrl-C does not end it first."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvbridge_bench.demo.lifecycle", *namespaces],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )


def stop_janitor(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """Close the janitor's pipe (it deletes what is left) and wait for it."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _janitor(namespaces: Sequence[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's Ctrl-C is the driver's
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    finally:
        from ..sim.emulator import netns

        for ns in namespaces:
            with contextlib.suppress(Exception):
                netns.delete_namespace(ns)
    return 0


if __name__ == "__main__":
    sys.exit(_janitor(sys.argv[1:]))
