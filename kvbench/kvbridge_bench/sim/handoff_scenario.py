"""One request through prefill, relay decode, main decode and the client, in
one process over an in-memory network: what the tests, the bench and the
demo run.  The prompt KV reaches each decode as a page copy in the wire
layout after an emulated delay (the transport's job in production).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbridge.errors import KVBridgeError
from kvbridge.handoff.driver import (
    MainResult,
    Pace,
    RelayResult,
    RequestSpec,
    StreamResult,
    prefill_request,
)
from kvbridge.handoff.engine import Engine
from kvbridge.handoff.messages import Kind, StreamTokens, decode
from kvbridge.handoff.node import HandoffNode
from kvbridge.handoff.outputs import HandoffTimeouts
from kvbridge.handoff.params import SamplingParams
from kvbridge.handoff.policy import HandoffPolicy
from kvbridge.handoff.sampling import sample
from kvbridge.pdd.aio import collect_stream, make_core, run_main, run_relay
from kvbridge.pdd.budget import RelayBudget
from kvbridge.pdd.core import PddCore

from .network import LinkModel, MemoryChannel, MemoryNetwork

__all__ = ["Scenario", "ScenarioResult", "decode_alone", "run_scenario"]


@dataclass(frozen=True)
class Scenario:
    """``main``: "ok"; "absent" (unreachable from the start); "dies" (its node
    dies after its first ACK).  ``relay_dies_after``: the relay's node dies
    right after it sent that many TOKENS messages (None: never).
    ``handoff_after``: the main decode's prompt KV lands ``main_kv_delay``
    after the relay has emitted this many tokens (None: after the delay
    alone), which fixes the handoff point whatever the machine's speed."""

    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    policy: HandoffPolicy = field(default_factory=HandoffPolicy)
    budget: RelayBudget = field(default_factory=RelayBudget)
    timeouts: HandoffTimeouts = field(default_factory=HandoffTimeouts)
    request_id: int = 1
    relay_kv_delay: float = 0.0
    main_kv_delay: float = 0.05
    peer_link: LinkModel = field(default_factory=LinkModel)
    client_link: LinkModel = field(default_factory=LinkModel)
    relay_pace: Pace = field(default_factory=Pace)
    main_pace: Pace = field(default_factory=Pace)
    relay_load: float = 0.0
    main: str = "ok"
    relay_dies_after: int | None = None
    handoff_after: int | None = None
    seed: int = 0
    gap_timeout: float = 5.0
    idle_timeout: float = 10.0


@dataclass
class ScenarioResult:
    stream: StreamResult
    relay: RelayResult | None
    main: MainResult | None
    errors: dict[str, BaseException] = field(default_factory=dict)
    peer_bytes: int = 0  # payload bytes between relay and main, both ways


class _Instrumented(MemoryChannel):
    """A node that dies after sending ``die_after`` messages of ``die_kind``,
    and sets ``reached`` once it has streamed ``stream_limit`` tokens (or the last)."""

    def __init__(
        self,
        network: MemoryNetwork,
        name: str,
        *,
        die_kind: Kind | None = None,
        die_after: int | None = None,
        stream_limit: int | None = None,
    ) -> None:
        super().__init__(network, name)
        self.die_kind, self.die_after, self.stream_limit = die_kind, die_after, stream_limit
        self.sent_kind = 0
        self.streamed = 0
        self.reached = asyncio.Event()

    async def send(self, dst: str, frame_type: int, payload: bytes) -> None:
        await super().send(dst, frame_type, payload)
        if frame_type == Kind.STREAM and self.stream_limit is not None:
            msg = decode(payload)
            if isinstance(msg, StreamTokens):
                self.streamed += len(msg.tokens)
                if self.streamed >= self.stream_limit or msg.last:
                    self.reached.set()
        if frame_type == self.die_kind and self.die_after is not None:
            self.sent_kind += 1
            if self.sent_kind >= self.die_after:
                self.network.kill(self.name)


def _loader(wire: torch.Tensor, delay: float, after: asyncio.Event | None = None) -> Any:
    async def load(engine: Engine, spec: RequestSpec) -> None:
        if after is not None:
            await after.wait()  # the caller's kv_timeout bounds this wait
        await asyncio.sleep(delay)
        engine.allocate(spec.request_id)
        engine.append_cached(spec.request_id, spec.prompt)
        write = getattr(engine, "write_kv")  # noqa: B009 - reference engines only
        write(spec.request_id, 0, wire)

    return load


def decode_alone(
    engine: Engine, request_id: int, prompt: list[int], params: SamplingParams
) -> list[int]:
    """The output of one engine decoding the prompt by itself."""
    spec = prefill_request(engine, request_id, prompt, params)
    out = [spec.first_token]
    try:
        while not params.is_last(len(out) - 1, out[-1]):
            logits = engine.decode({request_id: out[-1]})[request_id]
            out.append(sample(logits, params, len(out)))
    finally:
        engine.free(request_id)
    return out


async def run_scenario(
    sc: Scenario, prefill: Engine, relay: Engine, main: Engine, core: PddCore | None = None
) -> ScenarioResult:
    """Run one request end to end; every role's error is caught and reported.
    ``core``: one PDD core for the three roles (its log records them all),
    else one of the scenario's policy for each."""
    rid = sc.request_id
    spec = prefill_request(prefill, rid, list(sc.prompt), sc.params)
    read = getattr(prefill, "read_kv")  # noqa: B009
    wire = read(rid, 0, len(sc.prompt))
    prefill.free(rid)

    net = MemoryNetwork(seed=sc.seed)
    net.set_link("relay", "main", sc.peer_link, both=True)
    net.set_link("relay", "client", sc.client_link)
    net.set_link("main", "client", sc.client_link)
    relay_node = _Instrumented(
        net,
        "relay",
        die_kind=Kind.TOKENS,
        die_after=sc.relay_dies_after,
        stream_limit=sc.handoff_after,
    )
    net.attach(relay_node)
    after = relay_node.reached if sc.handoff_after is not None else None
    if sc.main == "dies":
        net.attach(_Instrumented(net, "main", die_kind=Kind.ACK, die_after=1))
    errors: dict[str, BaseException] = {}
    results: dict[str, Any] = {}

    async def guard(name: str, coro: Any) -> None:
        try:
            results[name] = await coro
        except (KVBridgeError, TimeoutError) as e:
            errors[name] = e

    try:
        async with (
            HandoffNode(net.node("relay")) as rn,
            HandoffNode(net.node("main")) as mn,
            HandoffNode(net.node("client")) as cn,
        ):
            if sc.main == "absent":
                net.kill("main")
            tasks = [
                guard(
                    "client",
                    collect_stream(
                        cn,
                        rid,
                        core=core,
                        gap_timeout=sc.gap_timeout,
                        idle_timeout=sc.idle_timeout,
                    ),
                ),
                guard(
                    "relay",
                    run_relay(
                        relay,
                        spec,
                        rn,
                        _loader(wire, sc.relay_kv_delay),
                        main="main",
                        client="client",
                        core=core
                        or make_core(sc.policy, sc.budget, sc.timeouts, relay_load=sc.relay_load),
                        pace=sc.relay_pace,
                    ),
                ),
            ]
            if sc.main != "absent":
                tasks.append(
                    guard(
                        "main",
                        run_main(
                            main,
                            spec,
                            mn,
                            _loader(wire, sc.main_kv_delay, after),
                            relay="relay",
                            client="client",
                            core=core,
                            timeouts=sc.timeouts,
                            pace=sc.main_pace,
                        ),
                    )
                )
            await asyncio.gather(*tasks)
    finally:
        net.close()
        for eng in (relay, main):
            with contextlib.suppress(KVBridgeError):
                eng.free(rid)
    if "client" in errors:
        raise errors["client"]
    peer = net.bytes_sent.get(("relay", "main"), 0) + net.bytes_sent.get(("main", "relay"), 0)
    return ScenarioResult(
        results["client"], results.get("relay"), results.get("main"), errors, peer
    )
