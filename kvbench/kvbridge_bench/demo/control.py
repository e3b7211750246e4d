"""The demo's control plane: JSON lines over Unix sockets.

Unix sockets cross network namespaces, so the driver reaches every role
process whichever side of the emulated WAN it runs on.  Only orchestration
travels here (submit a request, prepare the relay, report figures, forward the
client's stream); the KV, the prefix negotiation and the handoff travel over
kvbridge's transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from kvbridge.errors import ConnectTimeout, PeerGone, RemoteProtocolError, TransferTimeout

__all__ = ["ControlClient", "ControlServer"]

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]
EventHandler = Callable[[dict[str, Any]], None]
MAX_LINE = 16 << 20


async def _write(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
    await writer.drain()


class ControlServer:
    """A role's control socket.  ``handler(msg)`` answers calls (``id`` set);
    the server can also push events to every connected client."""

    def __init__(self, path: str, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=MAX_LINE)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def push(self, event: dict[str, Any]) -> None:
        """Send an event to every client (the driver's stream of tokens)."""
        for w in list(self._writers):
            try:
                await _write(w, event)
            except (ConnectionError, RuntimeError):
                self._writers.discard(w)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                task = asyncio.ensure_future(self._answer(writer, msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
        try:
            out = await self.handler(msg) or {}
            reply = {"id": msg.get("id"), "ok": True, **out}
        except Exception as e:  # reported to the caller, typed by name
            reply = {"id": msg.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"}
        if msg.get("id") is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await _write(writer, reply)


class ControlClient:
    """Calls a role's control socket; events go to ``on_event``."""

    def __init__(self, path: str, on_event: EventHandler | None = None) -> None:
        self.path = path
        self.on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None

    async def connect(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    self.path, limit=MAX_LINE
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise ConnectTimeout(
                        f"no control socket at {self.path} after {timeout} s"
                    ) from None
                await asyncio.sleep(0.1)
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self._reader is not None
        err: BaseException = PeerGone(f"control socket {self.path} closed")
        try:
            while line := await self._reader.readline():
                msg = json.loads(line)
                fut = self._pending.pop(msg.get("id"), None) if msg.get("id") else None
                if fut is not None:
                    if not fut.done():
                        fut.set_result(msg)
                elif self.on_event is not None:
                    self.on_event(msg)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            err = PeerGone(f"control socket {self.path}: {e!r}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    async def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        if self._writer is None:
            raise PeerGone("not connected")
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        await _write(self._writer, {"id": rid, "op": op, **args})
        try:
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self._pending.pop(rid, None)
            raise TransferTimeout(f"{op} on {self.path}: no answer after {timeout} s") from None
        if not reply.get("ok"):
            raise RemoteProtocolError(f"{op} failed on {self.path}: {reply.get('error')}")
        return reply

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
