"""A decode bridge in its own process, driven over stdin/stdout with JSON
lines, to kill (SIGKILL) and restart with the same identity and address: the
peer of the restart tests (tests/test_reliability.py) and of the soak
(tests/soak.py).

The child (``python tests/decode_proc.py KIND PORT``): ``tcp`` listens on
``127.0.0.1:PORT`` (identity ``dt``); ``ucx`` is a UCX decode (identity
``du``) that serves its metadata on ``127.0.0.1:PORT``
(``DecodeBridge(ucx_control=...)``).  It prints ``{"ready": ...}``, then
answers each ``{"rid", "pages", "n", "timeout"}`` line with the ticket of an
expectation and, when that ends, ``{"rid", "done": "ok", "sha"}`` (the hash
of the packed bytes that landed) or ``{"rid", "done": "<error class>"}``.

:class:`DecodeProc` is the parent's side.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

import numpy as np

LAYOUT = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16", page_tokens=16)
PAGES = 512


def layout() -> Any:
    from kvbridge.layout import KVLayout

    return KVLayout(**LAYOUT)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve(md: Any, dst: Any, kind: str, say: Any) -> None:
    """Answer the parent's JSON lines on stdin with expectations of ``md`` (a
    started DecodeBridge over ``dst``) until stdin closes, then close ``md``."""
    from kvbridge import pack

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_line(line: str) -> None:
        msg = json.loads(line)
        rid, pages, n = msg["rid"], np.asarray(msg["pages"], np.int32), msg["n"]
        try:
            e = md.expect(rid, pages, 0, n, via=kind, timeout=msg["timeout"])
        except Exception as ex:  # a typed refusal: reported, not fatal
            say({"rid": rid, "refused": type(ex).__name__})
            return
        say({"rid": rid, "ticket": e.ticket.hex()})

        def done(d: Any) -> None:
            res = d.outcome()
            if isinstance(res, BaseException):
                say({"rid": rid, "done": type(res).__name__})
            else:
                got = bytes(np.asarray(pack.pack(dst, pages, 0, n)))
                say({"rid": rid, "done": "ok", "sha": hashlib.sha256(got).hexdigest()})

        e.add_done_callback(done)

    def reader() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(on_line, line)
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=reader, daemon=True).start()
    await stop.wait()
    await md.close()


def child(kind: str, port: int) -> None:
    from kvbridge import pack
    from kvbridge.bridge import DecodeBridge

    lay = layout()
    out_lock = threading.Lock()

    def say(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    async def main() -> None:
        dst = pack.PagedKVCache.allocate(lay, PAGES)
        fast = {"keepalive_interval": 0.5, "keepalive_timeout": 3.0}
        if kind == "tcp":
            md = await DecodeBridge(
                dst, identity="dt", tcp_listen=("127.0.0.1", port), **fast
            ).start()
        else:
            md = await DecodeBridge(
                dst, identity="du", ucx=True, ucx_control=("127.0.0.1", port), **fast
            ).start()
        say({"ready": True, "pid": os.getpid()})
        await serve(md, dst, kind, say)

    asyncio.run(main())


class DecodeProc:
    """The parent's handle on one child; :meth:`restart` kills it (SIGKILL)
    and starts a new one with the same identity and port."""

    def __init__(self, kind: str, port: int | None = None) -> None:
        self.kind = kind
        self.port = port or free_port()
        self.proc: subprocess.Popen[str] | None = None
        self.generation = 0
        self._tickets: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._done: dict[str, asyncio.Future[dict[str, Any]]] = {}

    async def start(self, timeout: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
        self.proc = proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self.kind, str(self.port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1,
        )  # fmt: skip
        self.generation += 1
        gen = self.generation
        ready: asyncio.Future[dict[str, Any]] = loop.create_future()

        def deliver(msg: dict[str, Any]) -> None:
            if gen != self.generation:
                return
            if "ready" in msg:
                if not ready.done():
                    ready.set_result(msg)
                return
            rid = msg["rid"]
            table = self._tickets if ("ticket" in msg or "refused" in msg) else self._done
            f = table.pop(rid, None)
            if f is not None and not f.done():
                f.set_result(msg)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                loop.call_soon_threadsafe(deliver, msg)
            loop.call_soon_threadsafe(self._gone, gen)

        threading.Thread(target=read, daemon=True).start()
        await asyncio.wait_for(ready, timeout)

    def _gone(self, gen: int) -> None:
        if gen != self.generation:
            return
        for table in (self._tickets, self._done):
            for f in table.values():
                if not f.done():
                    f.set_result({"done": "peer process died"})
            table.clear()

    async def expect(
        self, rid: str, pages: list[int], n: int, timeout: float
    ) -> tuple[bytes | None, asyncio.Future[dict[str, Any]]]:
        """(the ticket, or None when the peer is down; the future of its outcome)."""
        loop = asyncio.get_running_loop()
        t: asyncio.Future[dict[str, Any]] = loop.create_future()
        d: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._tickets[rid], self._done[rid] = t, d
        if self.proc is None or self.proc.stdin is None:
            return None, d
        msg = {"rid": rid, "pages": pages, "n": n, "timeout": timeout}
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None, d
        r = await asyncio.wait_for(t, 30)
        if "ticket" not in r:
            return None, d
        return bytes.fromhex(r["ticket"]), d

    def kill(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                if s is not None:
                    s.close()
            except OSError:
                pass
        self._gone(self.generation)
        self.proc = None

    async def restart(self) -> None:
        self.kill()
        await self.start()

    def close(self) -> None:
        """End the child: closing its stdin lets it close its bridge and exit."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]))
