"""A main decode that dies before the switch, over real TCP: its connections
close with a reset (or a FIN) right after it sent READY, when the first
TOKENS message reaches it, or right after its first ACK, in one-shot and in
catch-up mode.  A failing control send counts as the main decode going
away: the relay decodes to the end (DEGRADED, the request kept) and the
client's stream is whole and equals one decoder decoding alone."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import pytest
from tcp_support import arun

from kvbridge.handoff import HandoffPolicy, HandoffTimeouts, Mode, SamplingParams
from kvbridge.handoff.channel import RoutedChannel
from kvbridge.handoff.driver import Pace, RequestSpec, prefill_request
from kvbridge.handoff.engine import Engine
from kvbridge.handoff.messages import Kind, StreamTokens, decode
from kvbridge.handoff.node import HandoffNode
from kvbridge.handoff.stream import StreamMerge
from kvbridge.pdd.aio import run_main, run_relay
from kvbridge.transport.tcp import TcpReceiver, TcpSender
from kvbridge_bench.reference import DecoderConfig, ReferenceDecoder
from kvbridge_bench.sim.handoff_scenario import decode_alone

CFG = DecoderConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    seed=5,
)
TIMEOUTS = HandoffTimeouts(
    ack_timeout=0.1,
    ack_per_token=0.001,
    max_retries=2,
    capped_wait=20.0,  # the relay never gives up on its own within the test
    ready_retry=0.05,
    relay_timeout=1.0,
)


def _kill(rx: TcpReceiver, how: str) -> None:
    """The main decode's process dies: every connection ends with a reset
    (SO_LINGER 0) or a FIN, and nothing listens any more."""
    server = rx._server
    if server is not None:
        server.close()
    for conn in list(rx._conns):
        tr = conn.transport
        if tr is None or tr.is_closing():
            continue
        if how == "rst":
            sock = tr.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            tr.abort()
        else:
            tr.close()


def _loader(wire: Any, after: asyncio.Event | None = None) -> Any:
    async def load(engine: Engine, spec: RequestSpec) -> None:
        if after is not None:
            await after.wait()
        engine.allocate(spec.request_id)
        engine.append_cached(spec.request_id, spec.prompt)
        engine.write_kv(spec.request_id, 0, wire)  # type: ignore[attr-defined]

    return load


async def _scenario(mode: Mode, phase: str, how: str) -> None:
    prefill = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=16), 16)
    relay_eng = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=8, order="page_first"), 32)
    main_eng = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=32, head_order="HND"), 8)
    params = SamplingParams(temperature=0.8, top_k=20, seed=77, max_new_tokens=40)
    prompt = [(7 * i + 3) % CFG.vocab_size for i in range(21)]
    want = decode_alone(prefill, 99, prompt, params)
    spec = prefill_request(prefill, 1, prompt, params)
    wire = prefill.read_kv(1, 0, len(prompt))
    prefill.free(1)

    rx = await TcpReceiver(identity="main-decode").start()
    tx = TcpSender("127.0.0.1", rx.port, identity="relay", streams=1, reconnect_timeout=5.0)
    await tx.connect()
    md, rld = RoutedChannel("md"), RoutedChannel("rld")
    md.link_receiver("rld", rx, "relay")
    rld.link_sender("md", tx)

    merge = StreamMerge(1, gap_timeout=10.0, idle_timeout=10.0, now=0.0)
    streamed = asyncio.Event()  # the relay has emitted enough for a catch-up round
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def to_client(frame_type: int, payload: bytes) -> None:
        msg = decode(payload, frame_type)
        assert isinstance(msg, StreamTokens)
        merge.push(msg, loop.time())
        if len(merge.tokens) >= 10:
            streamed.set()
        if merge.done:
            done.set()

    rld.route("client", to_client)
    md.route("client", to_client)

    killed = asyncio.Event()

    def kill_soon() -> None:
        if not killed.is_set():
            killed.set()
            # after the bytes just queued have left: the relay sees them, then the loss
            loop.call_later(0.02, _kill, rx, how)

    # the main decode dies at the chosen phase
    send_to_relay = md._routes["rld"]
    acks = 0

    def md_route(frame_type: int, payload: bytes) -> Any:
        nonlocal acks
        if killed.is_set():
            return None  # a dead process sends nothing
        res = send_to_relay(frame_type, payload)
        if phase == "ready" and frame_type == Kind.READY:
            kill_soon()
        if phase == "ack" and frame_type == Kind.ACK:
            acks += 1
            kill_soon()
        return res

    md.route("rld", md_route)
    deliver = md.deliver

    def md_deliver(src: str, frame_type: int, payload: bytes) -> None:
        if killed.is_set():
            return
        if phase == "tokens" and frame_type == Kind.TOKENS:
            kill_soon()
            return
        deliver(src, frame_type, payload)

    md.deliver = md_deliver  # type: ignore[method-assign]

    policy = HandoffPolicy(threshold=2, max_rounds=4, force=mode)
    async with HandoffNode(md) as mn, HandoffNode(rld) as rn:
        main_task = asyncio.ensure_future(
            run_main(
                main_eng,
                spec,
                mn,
                _loader(wire, streamed),
                relay="rld",
                client="client",
                timeouts=TIMEOUTS,
                kv_timeout=10.0,
                pace=Pace(extend_base_s=0.05),
            )
        )
        res = await run_relay(
            relay_eng,
            spec,
            rn,
            _loader(wire),
            main="md",
            client="client",
            policy=policy,
            timeouts=TIMEOUTS,
            kv_timeout=10.0,
            pace=Pace(decode_s=0.01),
        )
        await asyncio.wait_for(done.wait(), 10.0)
        assert killed.is_set()
        main_task.cancel()
        await asyncio.gather(main_task, return_exceptions=True)
    assert res.kept, res  # finished on the relay because the main decode failed
    assert merge.tokens == want
    assert merge.conflicts == 0
    await tx.close()
    await rx.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["rst", "fin"])
@pytest.mark.parametrize(
    ("mode", "phase"),
    [
        (Mode.ONE_SHOT, "ready"),
        (Mode.ONE_SHOT, "tokens"),
        (Mode.CATCH_UP, "ready"),
        (Mode.CATCH_UP, "tokens"),
        (Mode.CATCH_UP, "ack"),
    ],
)
def test_relay_survives_a_dead_main_decode(mode: Mode, phase: str, how: str) -> None:
    arun(_scenario(mode, phase, how), timeout=45.0)


def test_state_machines_take_a_failed_send_for_the_peer_going_away() -> None:
    from kvbridge.handoff import MainSide, MainState, RelaySide, RelayState
    from kvbridge.handoff.messages import Done, DoneReason, Ready
    from kvbridge.handoff.outputs import ToClient, ToPeer

    params = SamplingParams(0.0, max_new_tokens=10)
    # the relay, mid-handoff (COMMITTING): it degrades and keeps the request
    r = RelaySide(1, params, HandoffPolicy(force=Mode.ONE_SHOT), TIMEOUTS)
    r.start(5, 0.0)
    r.on_token(6, 0.0)
    r.on_message(Ready(1, 3, 1), 0.0)
    assert r.state is RelayState.COMMITTING
    out = r.peer_gone(0.1)
    assert r.state is RelayState.DEGRADED and r.kept and r.want_decode
    assert out == [ToPeer(Done(1, DoneReason.KEPT, 2))]
    assert r.peer_gone(0.2) == []  # once is enough
    # before its first token, the relay starts degraded
    r2 = RelaySide(2, params, timeouts=TIMEOUTS)
    r2.peer_gone(0.0)
    r2.start(5, 0.1)
    assert r2.state is RelayState.DEGRADED and r2.tokens == [5]
    # the main decode, holding: it takes over with what it holds
    m = MainSide(1, params, 3, 5, TIMEOUTS)
    m.on_kv_ready(0.0)
    assert m.state is MainState.HOLDING
    out = m.peer_gone(0.1)
    assert m.state is MainState.EMITTING and m.took_over and m.switch_at == 1
    assert isinstance(out[0], ToClient) and out[0].message.tokens == (5,)
    # waiting for its KV: it takes over as soon as the KV lands
    m2 = MainSide(2, params, 3, 5, TIMEOUTS)
    assert m2.peer_gone(0.0) == []
    m2.on_kv_ready(0.1)
    assert m2.state is MainState.EMITTING and m2.took_over


def test_main_decode_takes_over_when_the_relay_is_gone() -> None:
    """The mirror case: the relay's connection resets after its first TOKENS
    message; the main decode's ACK cannot be sent, so it takes over at once."""

    async def main() -> None:
        prefill = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=16), 16)
        main_eng = ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=32, head_order="HND"), 8)
        params = SamplingParams(temperature=0.0, max_new_tokens=30)
        prompt = [(5 * i + 1) % CFG.vocab_size for i in range(19)]
        want = decode_alone(prefill, 99, prompt, params)
        spec = prefill_request(prefill, 1, prompt, params)
        wire = prefill.read_kv(1, 0, len(prompt))
        prefill.free(1)
        rx = await TcpReceiver(identity="main-decode").start()
        tx = TcpSender("127.0.0.1", rx.port, identity="relay", streams=1)
        await tx.connect()
        md = RoutedChannel("md")
        md.link_receiver("rld", rx, "relay")
        loop = asyncio.get_running_loop()
        merge = StreamMerge(1, gap_timeout=10.0, idle_timeout=10.0, now=0.0)

        def to_client(frame_type: int, payload: bytes) -> None:
            msg = decode(payload, frame_type)
            assert isinstance(msg, StreamTokens)
            merge.push(msg, loop.time())

        md.route("client", to_client)
        # the relay emitted [0, 4), handed them over, and died with a reset
        from kvbridge.handoff.messages import Source, Tokens, encode

        relay_out = want[:4]
        merge.push(StreamTokens(1, 0, tuple(relay_out), Source.RELAY, False), 0.0)
        tx.send_control(Kind.TOKENS, encode(Tokens(1, 1, tuple(relay_out[1:]), params)))
        await asyncio.sleep(0.1)
        for link in tx._links:
            tr = link.conn.transport
            if tr is not None:
                sock = tr.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                tr.abort()
        await tx.close()
        await asyncio.sleep(0.1)
        t0 = loop.time()
        async with HandoffNode(md) as mn:
            res = await run_main(
                main_eng,
                spec,
                mn,
                _loader(wire),
                relay="rld",
                client="client",
                timeouts=TIMEOUTS,
                kv_timeout=10.0,
            )
        assert res.took_over and merge.done and merge.tokens == want
        assert loop.time() - t0 < TIMEOUTS.relay_timeout  # not by the silence deadline
        await rx.close()

    arun(main(), timeout=30.0)


def test_a_relay_that_took_the_main_decode_for_failed_does_not_keep_a_switched_request() -> None:
    from kvbridge.handoff import RelaySide, RelayState
    from kvbridge.handoff.messages import Ack, Ready

    r = RelaySide(1, SamplingParams(0.0, max_new_tokens=10), HandoffPolicy(force=Mode.ONE_SHOT))
    r.start(5, 0.0)
    r.on_message(Ready(1, 3, 1), 0.0)
    r.peer_gone(0.1)  # a failed send: degraded, it would keep the request
    assert r.kept and r.state is RelayState.DEGRADED
    r.on_message(Ack(1, 1, True, 1), 0.2)  # the main decode switched after all
    assert r.state is RelayState.SWITCHED and not r.kept
