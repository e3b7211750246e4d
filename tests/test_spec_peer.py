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


def test_two_spec_senders_one_token_the_second_is_refused_source_conflict(tmp_path: Path) -> None:
    """protocol.md 5.1, one live source per transfer: the spec sender A
    (its own source id) is bound; a second spec sender B with other bytes
    and another source id is refused with ABORT SOURCE_CONFLICT, and A's
    bytes are what the sink holds."""
    path_a, data_a = _payload(tmp_path, 3_000_001, "random")
    path_b, _ = _payload(tmp_path, 3_000_001, "fp16")

    async def main() -> None:
        from tcp_support import FaultProxy

        rx = await TcpReceiver(psk=PSK).start()
        proxy = FaultProxy(rx.port)
        port = await proxy.start()
        sink = BytesSink(len(data_a))
        h = rx.expect("req-1", sink, timeout=60)
        t = h._transfer
        common = ["--psk", PSK.hex(), "--chunk-size", "65536", "--connections", "2"]
        try:
            a = await _run("indep_sender.py", f"127.0.0.1:{port}", str(path_a), h.token.hex(),
                           *common, "--source", "aa" * 16)  # fmt: skip
            loop = asyncio.get_running_loop()
            end = loop.time() + 30
            while t.received_bytes == 0:
                assert loop.time() < end
                await asyncio.sleep(0.002)
            proxy.stall = True  # A stays live, sending nothing for now
            assert t.source[1] == bytes.fromhex("aa" * 16)  # its OPEN named its source
            b = await _run("indep_sender.py", f"127.0.0.1:{rx.port}", str(path_b), h.token.hex(),
                           *common)  # fmt: skip
            res_b = await _finish(b)
            assert res_b["result"] == "error" and "SOURCE_CONFLICT" in str(res_b["error"]), res_b
            proxy.stall = False
            res_a = await _finish(a)
            await h.wait(10)
            assert res_a["result"] == "ok", res_a
            assert bytes(sink.data) == data_a and t.conflicts >= 1
        finally:
            await proxy.close()
            await rx.close()

    arun(main(), 90)


def test_kvbridge_senders_into_spec_receiver_the_second_live_one_is_refused(
    tmp_path: Path,
) -> None:
    """The spec receiver, written from 5.1, binds the transfer to kvbridge's
    first sender and refuses a second one (another source id) with
    SOURCE_CONFLICT, which kvbridge raises as SourceConflict."""
    from kvbridge.errors import SourceConflict

    path, data = _payload(tmp_path, 3_000_003, "fp16")

    async def main() -> None:
        proc = await _run("indep_receiver.py", str(path), "--psk", PSK.hex(), "--timeout", "50")
        txs: list[TcpSender] = []
        try:
            assert proc.stdout is not None
            info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
            token = bytes.fromhex(info["token"])
            txs = [TcpSender("127.0.0.1", info["port"], psk=PSK, streams=2, chunk_size=65536,
                             compression="off") for _ in range(2)]  # fmt: skip
            first = txs[0].send("req-1", BytesSource(data, itemsize=2), token=token)
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            while not first._transfer.resumed:  # type: ignore[attr-defined]
                assert loop.time() < end
                await asyncio.sleep(0.002)
            other = bytes(b ^ 0xFF for b in data[:1000]) + data[1000:]
            second = txs[1].send("req-1", BytesSource(other, itemsize=2), token=token)
            with pytest.raises(SourceConflict):
                await second.wait(30)
            await first.wait(30)
            res = await _finish(proc)
            assert res["result"] == "ok", res
            assert res["stats"]["source_conflict"] >= 1  # type: ignore[index]
        finally:
            for tx in txs:
                await tx.close()
            if proc.returncode is None:
                proc.kill()
                await proc.communicate()

    arun(main(), 90)
