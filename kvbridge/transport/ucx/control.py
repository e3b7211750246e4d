"""Metadata exchange over a small TCP control connection.

``serve_metadata(agent, host, port)`` answers every connection with the
agent's metadata blob; ``connect_via_tcp(agent, host, port)`` fetches a peer's
blob and connects to it.  Frames are ``u32 little-endian length + blob``,
bounded by ``MAX_METADATA``.  Engines that already have a control plane can
move ``agent.metadata()`` themselves and call ``agent.connect(blob)``.
"""

from __future__ import annotations

import asyncio
import struct

from ...errors import ConnectTimeout, PeerGone, RemoteProtocolError
from . import UcxAgent, UcxPeer
from .metadata import MAX_METADATA

__all__ = ["connect_via_tcp", "fetch_metadata", "serve_metadata"]

_LEN = struct.Struct("<I")


async def serve_metadata(
    agent: UcxAgent, host: str = "127.0.0.1", port: int = 0, *, blob: bytes | None = None
) -> asyncio.Server:
    """Serve ``agent.metadata()`` (or ``blob``: what wraps it, e.g. a decode
    bridge's metadata) to whoever connects; returns the server
    (``server.sockets[0].getsockname()[1]`` is the port when ``port=0``).
    A peer that restarts serves its new metadata on the same port: a sender
    fetches it again to reconnect."""
    agent.start()
    if blob is None:
        blob = bytes(agent.metadata())

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(_LEN.pack(len(blob)) + blob)
            await asyncio.wait_for(writer.drain(), 5.0)
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 5.0)
            except (OSError, TimeoutError):
                pass

    return await asyncio.start_server(handle, host, port)


async def fetch_metadata(host: str, port: int, timeout: float = 10.0) -> bytes:
    """Read a peer's metadata blob from its control port."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except TimeoutError:
        raise ConnectTimeout(f"control connection to {host}:{port} timed out") from None
    except OSError as e:
        raise PeerGone(f"control connection to {host}:{port} failed: {e}") from None
    try:
        head = await asyncio.wait_for(reader.readexactly(_LEN.size), timeout)
        (n,) = _LEN.unpack(head)
        if n > MAX_METADATA:
            raise RemoteProtocolError(f"control peer announced {n} bytes of metadata")
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except TimeoutError:
        raise ConnectTimeout(f"metadata from {host}:{port} did not arrive in {timeout} s") from None
    except asyncio.IncompleteReadError:
        raise PeerGone(f"control peer {host}:{port} closed before sending its metadata") from None
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), timeout)
        except (OSError, TimeoutError):
            pass


async def connect_via_tcp(agent: UcxAgent, host: str, port: int, timeout: float = 10.0) -> UcxPeer:
    """Fetch the peer's metadata over TCP and connect to it."""
    blob = await fetch_metadata(host, port, timeout)
    return await agent.connect(blob, timeout=timeout)
