"""Over UCX, a receive's terminal outcome means that no byte of its request
can land in its pages any more (docs/ucx.md, "Ending a request"): right
after the handle ends, the test overwrites the pages with a sentinel, lets
the sender finish and time pass, and checks that the sentinel is intact.

Real UCX over UCX_TLS=tcp: two agents in this process (the sender paced by
a small put window, so that the transfer is in the middle when it is ended),
and a sender in a child process that is stopped (SIGSTOP) so that it never
acknowledges the receiver's ABORT."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import ucx_workers
from ucx_cases import agent as ucx_agent
from ucx_cases import make_cache

from kvbridge.errors import Cancelled, KVBridgeError, TransferAborted, TransferTimeout
from kvbridge.layout import KVLayout
from kvbridge.transport import ucx

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not ucx.available(), reason=f"UCX unavailable: {ucx.unavailable_reason()}"),
]

# 4 layers x 8 heads x 128 x fp16, 16 tokens a page: 64 KiB per page and layer
LAY = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, page_tokens=16)
PAGES = 384  # 96 MiB of cache on each side
TOKENS = PAGES * 16
SENTINEL = 0x5A5A


@pytest.fixture(autouse=True)
def _tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")


def run(fn: Callable[[], Awaitable[None]], timeout: float = 60.0) -> None:
    async def main() -> None:
        await asyncio.wait_for(fn(), timeout)

    asyncio.run(main())


def landed_any(cache: list[np.ndarray]) -> bool:
    return any(bool(t.any()) for t in cache)


def overwrite(cache: list[np.ndarray]) -> None:
    for t in cache:
        t[...] = SENTINEL


def intact(cache: list[np.ndarray]) -> bool:
    return all(bool((t == SENTINEL).all()) for t in cache)


async def until_landing(cache: list[np.ndarray], what: Any) -> None:
    """Wait until the first bytes of the transfer are in ``cache``; it must
    not have ended by then (else the test does not test the middle)."""
    for _ in range(20000):
        if landed_any(cache):
            return
        await asyncio.sleep(0.0005)
    raise AssertionError(f"nothing landed ({what})")


async def pair(**kw: Any) -> tuple[Any, Any, Any, list[np.ndarray], list[np.ndarray]]:
    from kvbridge import pack

    src, dst = make_cache(LAY, PAGES, 3), make_cache(LAY, PAGES, None)
    a = ucx_agent(LAY, src, min_put_run_bytes=0, put_window=2, packer=pack, **kw)
    b = ucx_agent(LAY, dst, min_put_run_bytes=0, packer=pack, **kw)
    peer = await a.connect(b.metadata())
    return a, b, peer, src, dst


@pytest.mark.parametrize(
    "end", ["receiver_cancel", "receiver_deadline", "sender_cancel", "receiver_cancel_staged"]
)
def test_no_byte_lands_after_the_receive_ended(end: str) -> None:
    """A large transfer is ended in the middle (by the receiver's cancel or
    deadline, or by the sender's cancel; put path, and the staging path
    whose unpack writes the pages); right after the receive's handle ends
    its pages are overwritten with a sentinel, and once the sender's handle
    ended too and more time passed, not one byte of the sentinel has
    changed."""

    async def body() -> None:
        staged = end.endswith("_staged")
        kw = {"staging_bytes": 1 << 20, "staging_slots": 2} if staged else {}
        a, b, peer, _src, dst = await pair(**kw)
        rng = np.random.default_rng(1)
        sbt, dbt = rng.permutation(PAGES), rng.permutation(PAGES)  # page-sized runs
        he = b.expect("big", dbt, 0, TOKENS)
        hs = peer.send("big", sbt, dbt, 0, TOKENS, path="staging" if staged else None)
        assert not hs.done(), "the transfer completed inline: nothing to end in the middle"
        await until_landing(dst, end)
        if end == "receiver_deadline":
            # what the agent's deadline timer calls when the expect's timeout
            # passes, called now: in the middle of the transfer, whatever the
            # speed of this machine
            he._expire()
        elif end.startswith("receiver_cancel"):
            he.cancel()
        else:
            hs.cancel()
        want = {
            "receiver_cancel": Cancelled,
            "receiver_cancel_staged": Cancelled,
            "receiver_deadline": TransferTimeout,
            "sender_cancel": TransferAborted,
        }[end]
        with pytest.raises(want):
            await he
        overwrite(dst)  # the receiver frees the pages and reuses them at once
        with contextlib.suppress(KVBridgeError):  # (it fails: Cancelled, TransferAborted)
            await hs
        await asyncio.sleep(1.0)  # what the sender still had posted would have landed by now
        assert intact(dst), "a put of the ended request landed after the receive ended"
        await a.close()
        await b.close()

    run(body)


def test_an_unbound_receive_quiesces_every_connected_sender() -> None:
    """A receive bound to no sender yet (its first part has not arrived: a
    single large part in flight) asks every connected peer to stop, and a
    peer that sends nothing of it acknowledges at once."""

    async def body() -> None:
        a, b, peer, _src, dst = await pair()
        idle_cache = make_cache(LAY, 8, None)
        idle = ucx_agent(LAY, idle_cache, min_put_run_bytes=0)
        await idle.connect(b.metadata())
        rng = np.random.default_rng(2)
        sbt, dbt = rng.permutation(PAGES), rng.permutation(PAGES)
        he = b.expect("solo", dbt, 0, TOKENS)
        hs = peer.send("solo", sbt, dbt, 0, TOKENS)
        await until_landing(dst, "unbound")
        he.cancel()
        with pytest.raises(Cancelled):
            await he
        overwrite(dst)
        with pytest.raises(KVBridgeError):
            await hs
        await asyncio.sleep(1.0)
        assert intact(dst)
        assert b.stats()["abort_unacked"] == 0  # both acknowledged
        assert len(b.peers) == 2
        await idle.close()
        await a.close()
        await b.close()

    run(body)


class StoppableSender:
    """An agent in a child process (tests/ucx_workers.py) that the test can
    stop with SIGSTOP: it then answers nothing, ABORT included."""

    def __init__(self, mode: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        opts = {"put_window": 2, "min_put_run_bytes": 0}
        self.p = ctx.Process(
            target=ucx_workers.agent_main,
            args=(child, {"UCX_TLS": "tcp"}, LAY, PAGES, 5, mode, opts),
        )
        self.p.start()
        child.close()
        self.md = self.recv(30)[1]

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"no answer within {timeout} s")
        return self.conn.recv()

    def stop(self) -> None:
        if self.p.is_alive():
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        self.p.join(10)


@pytest.mark.parametrize("mode", ["peer", "none"])
def test_a_sender_that_never_acknowledges_is_closed_within_the_quiesce_deadline(mode: str) -> None:
    """The receiver cancels while its sender is stopped (SIGSTOP) in the
    middle of a large put: the ABORT is never acknowledged, so after
    ``abort_quiesce`` the receiver closes the sender's endpoint and reports
    the cancel.  With error mode "peer" (puts travel as UCX active messages
    over TCP, which a closed endpoint no longer takes) the sender then
    resumes and nothing it had posted or still posts lands in the pages.
    With error mode "none" UCX's zero-copy TCP put arrives on a connection
    the sender opened, which the receiver's close does not end: only the
    report within the deadline is checked (docs/ucx.md, "Ending a request").
    (Run in a child process started with UCX_TLS=tcp, as its sender is.)"""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import test_ucx_quiesce as t; "
        f"t._unacknowledged_abort_case({mode!r})"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
        env=dict(os.environ, UCX_TLS="tcp"),
    )  # fmt: skip
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "unacknowledged abort case: ok" in r.stdout, r.stdout[-2000:]


def _unacknowledged_abort_case(mode: str) -> None:
    proc = StoppableSender(mode)
    try:

        async def body() -> None:
            dst = make_cache(LAY, PAGES, None)
            b = ucx_agent(
                LAY, dst, min_put_run_bytes=0, abort_quiesce=1.0, peer_timeout=30.0, error_mode=mode
            )
            proc.send("connect", b.metadata())
            loop = asyncio.get_running_loop()
            # (the answer is awaited off the loop: the loop answers the HELLO)
            assert (await loop.run_in_executor(None, proc.recv, 30))[0] == "ok"
            rng = np.random.default_rng(4)
            sbt, dbt = rng.permutation(PAGES), rng.permutation(PAGES)
            for attempt in range(5):
                # stopped in the middle of its puts; on a fast, idle machine the
                # whole send may land before the stop: then again, a new request
                rid = f"stopped-{attempt}"
                he = b.expect(rid, dbt, 0, TOKENS)
                proc.send("send", [(0, rid, sbt, dbt, 0, TOKENS, [None])])
                await until_landing(dst, "stopped sender")
                os.kill(proc.p.pid, signal.SIGSTOP)
                await asyncio.sleep(0.05)  # what was in flight is handled first
                if not he.done():
                    break
                os.kill(proc.p.pid, signal.SIGCONT)
                await he
                await loop.run_in_executor(None, proc.recv, 30)  # the sender's report
                for t in dst:
                    t[...] = 0
            else:
                raise AssertionError("every send landed whole before its sender was stopped")
            t0 = loop.time()
            he.cancel()
            with pytest.raises(Cancelled):
                await he
            waited = loop.time() - t0
            assert 1.0 <= waited < 1.0 + 2.0, waited  # the quiesce deadline (slack: a busy VM)
            overwrite(dst)
            assert b.stats()["abort_unacked"] == 1
            assert b.peers == []  # its endpoint was closed
            os.kill(proc.p.pid, signal.SIGCONT)
            await asyncio.sleep(2.0)  # the sender runs again: whatever it still posts
            if mode == "peer":
                assert intact(dst), "a put of a sender that never acknowledged landed"
            await b.close()

        run(body)
        print("unacknowledged abort case: ok")
    finally:
        proc.stop()


@pytest.mark.parametrize("late", [False, True])
def test_a_part_drained_with_its_senders_failure_fails_the_unbound_receive(late: bool) -> None:
    """A sender's DONE arrived and then its endpoint failed (it was killed):
    when both are drained in one batch, or the DONE only in the next one
    (``late``), the receive the DONE binds fails at once with the sender's
    death, as a receive bound to it before does, instead of waiting for its
    deadline on a sender that is gone (the batch's failure used to be applied
    first, while the receive was bound to no sender)."""
    from kvbridge.errors import PeerGone

    async def body() -> None:
        a, b, _peer, _src, _dst = await pair()
        he = b.expect("k", np.arange(PAGES), 0, TOKENS, timeout=30.0)  # bound to no sender
        (ex,) = b._expectations._tokens.values()
        assert ex.peer is None
        sender = b.peer(a.agent_id)
        failure = (sender._ep, -25)  # ERR_CONNECTION_RESET
        part = (ex.token, 0, 1, LAY.page_bytes_per_layer * PAGES, a.agent_id, 1, False)
        if late:
            b._events(([], [failure], [], []))
            b._events(([], [], [], [part]))
        else:
            b._events(([], [failure], [], [part]))
        with pytest.raises(PeerGone):
            await asyncio.wait_for(he, 5.0)
        await a.close()
        await b.close()

    run(body)
