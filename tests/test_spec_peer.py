"""kvbridge interoperates with a peer written from docs/protocol.md alone
(tests/spec_peer): its sender into our receiver (striped, one chunk damaged
on the way, compressed and shuffled), our sender into its receiver (zstd and
lz4 with the byte shuffle, four streams, small chunks)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tcp_support import arun

from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge.transport.tcp.kvio import BytesSink, BytesSource

PEER = Path(__file__).resolve().parent / "spec_peer"
PSK = bytes(range(32))


def _payload(tmp_path: Path, n: int, kind: str) -> tuple[Path, bytes]:
    rng = np.random.default_rng(n)
    if kind == "fp16":  # compresses after the shuffle, like KV
        data = rng.standard_normal(n // 2).astype(np.float16).tobytes() + b"\x07" * (n % 2)
    else:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    path = tmp_path / f"payload-{kind}-{n}.bin"
    path.write_bytes(data)
    return path, data


async def _run(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, *args, cwd=PEER,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _finish(proc: asyncio.subprocess.Process, timeout: float = 60) -> dict[str, object]:
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    lines = [ln for ln in out.decode().splitlines() if '"result"' in ln]
    assert lines, f"the spec peer printed no result; stderr:\n{err.decode()[-3000:]}"
    return dict(json.loads(lines[-1]))


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("random", ["--connections", "3", "--corrupt-chunk", "5"]),
        ("fp16", ["--connections", "2", "--compression", "zstd", "--shuffle"]),
        ("fp16", ["--connections", "1", "--compression", "lz4", "--shuffle"]),
    ],
)
def test_spec_sender_into_kvbridge_receiver(tmp_path: Path, kind: str, extra: list[str]) -> None:
    path, data = _payload(tmp_path, 5_000_001, kind)

    async def main() -> None:
        rx = await TcpReceiver(psk=PSK).start()
        sink = BytesSink(len(data))
        h = rx.expect("req-1", sink, timeout=60)
        try:
            proc = await _run(
                "indep_sender.py", f"127.0.0.1:{rx.port}", str(path), h.token.hex(),
                "--psk", PSK.hex(), "--chunk-size", "262144", *extra,
            )  # fmt: skip
            res = await _finish(proc)
            await h.wait(10)
            assert res["result"] == "ok", res
            assert proc.returncode == 0
            assert bytes(sink.data) == data
            if "--corrupt-chunk" in extra:
                assert h.stats.bad_chunks == 1
        finally:
            await rx.close()

    arun(main())


@pytest.mark.parametrize(
    ("compression", "streams", "chunk"),
    [("zstd", 2, None), ("lz4", 4, 65536), ("off", 4, 65536)],
)
def test_kvbridge_sender_into_spec_receiver(
    tmp_path: Path, compression: str, streams: int, chunk: int | None
) -> None:
    path, data = _payload(tmp_path, 3_000_003, "fp16")

    async def main() -> None:
        proc = await _run("indep_receiver.py", str(path), "--psk", PSK.hex(), "--timeout", "50")
        tx: TcpSender | None = None
        try:
            assert proc.stdout is not None
            info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
            tx = TcpSender(
                "127.0.0.1", info["port"], psk=PSK, streams=streams, chunk_size=chunk,
                compression=compression,
            )  # fmt: skip
            st = await tx.send(
                "req-1", BytesSource(data, itemsize=2), token=bytes.fromhex(info["token"])
            ).wait(60)
            assert st.bytes == len(data)
            want = {"off": "raw", "lz4": "lz4", "zstd": "zstd"}[compression]
            assert st.compression["codec"] == want  # the chunks really went this way
            assert st.compression["shuffle"] == (0 if compression == "off" else 2)
            res = await _finish(proc)
            assert res["result"] == "ok", res
            assert proc.returncode == 0
        finally:
            if tx is not None:
                await tx.close()
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()

    arun(main())


def test_the_spec_peer_imports_nothing_of_kvbridge() -> None:
    files = list(PEER.glob("*.py"))
    assert len(files) == 3
    for f in files:
        text = f.read_text()
        assert "import kvbridge" not in text and "from kvbridge" not in text, f.name
