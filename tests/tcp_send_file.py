"""A kvbridge sender in its own process (so that a test can kill it with
SIGKILL mid-transfer): sends FILE to HOST:PORT with TOKEN, then waits.

    python tcp_send_file.py HOST PORT TOKEN_HEX FILE CHUNK STREAMS
"""

from __future__ import annotations

import asyncio
import sys

from kvbridge.transport.tcp import TcpSender, run
from kvbridge.transport.tcp.kvio import BytesSource


async def main() -> None:
    host, port, token, path, chunk, streams = sys.argv[1:7]
    with open(path, "rb") as f:
        data = f.read()
    tx = TcpSender(host, int(port), chunk_size=int(chunk), streams=int(streams), compression="off")
    h = tx.send("r", BytesSource(data), token=bytes.fromhex(token), timeout=120)
    print("sending", flush=True)
    await h.wait()
    print("done", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    run(main())
