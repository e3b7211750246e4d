"""Both drivers of the PDD core make the same decisions for the same
request: the reference demo's (kvbridge.pdd.aio: the relay, the main decode
and the client over a handoff message channel, with the reference engine)
and the vLLM proxy's (kvbridge.integrations.vllm.handoff.HttpHandoff: what
the proxy hears from vLLM over HTTP).  Each records its core's log; the
decisions in it (handoff messages, relay stops, extends and the switch, the
client's stream) are compared.  The proxy's driver is also checked alone:
one-shot and catch-up handoff, the relay's end of stream, a failed relay,
every token once."""

from __future__ import annotations

import asyncio
from typing import Any

from kvbridge.handoff import HandoffPolicy, HandoffTimeouts, Mode, SamplingParams
from kvbridge.integrations.vllm.handoff import (
    Continue,
    Done,
    Extend,
    HttpHandoff,
    MainAlone,
    RestartRelay,
    Show,
    StopRelay,
)
from kvbridge.pdd import (
    Command,
    Deliver,
    Ended,
    MainExtend,
    PddConfig,
    PddCore,
    RelayBudget,
    RelayRun,
    SendHandoff,
    StreamDone,
)
from kvbridge_bench.reference import DecoderConfig, ReferenceDecoder
from kvbridge_bench.sim.handoff_scenario import Scenario, decode_alone, run_scenario

CFG = DecoderConfig(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=256,
    seed=11,
)
TIMEOUTS = HandoffTimeouts(ack_timeout=2.0, relay_timeout=10.0, capped_wait=10.0)


def config(budget: int) -> PddConfig:
    return PddConfig(
        handoff=HandoffPolicy(force=Mode.ONE_SHOT),
        budget=RelayBudget(token_budget=budget, min_budget=1),
        timeouts=TIMEOUTS,
        relay_load=0.0,
    )


def decisions(log: list[tuple[Any, list[Command]]]) -> dict[str, list[Any]]:
    """The decisions in a core's log, by kind, in order (the handoff messages
    per direction: the two directions interleave as the transport delivers)."""
    out: dict[str, list[Any]] = {
        "to_main": [],
        "to_relay": [],
        "relay": [],
        "extend": [],
        "ended": [],
    }
    stream: list[tuple[int, str]] = []
    done: list[Any] = []
    for _, cmds in log:
        for c in cmds:
            if isinstance(c, SendHandoff):
                m = c.message
                fields = {k: v for k, v in vars(m).items() if k not in ("params",)}
                out[f"to_{c.to.value}"].append((type(m).__name__, fields))
            elif isinstance(c, RelayRun):
                out["relay"].append(c.run)
            elif isinstance(c, MainExtend):
                out["extend"].append((c.start, c.tokens, c.switch))
            elif isinstance(c, Ended):
                out["ended"].append((c.role.value, c.state))
            elif isinstance(c, Deliver):
                stream += [(t, c.source.name) for t in c.tokens]
            elif isinstance(c, StreamDone):
                done.append((c.tokens, c.duplicates, c.switch_at))
    out["ended"].sort()
    out["stream"] = stream
    out["done"] = done
    return out


def test_the_demo_driver_and_the_proxy_driver_decide_alike() -> None:
    """A request whose main decode holds the prompt KV only after the relay
    reached its budget (6 tokens): READY, one TOKENS with the commit, the
    main decode's step of token 0 and one extend of tokens 1..5 that
    switches, then the main decode's tokens; the same in both drivers."""
    params = SamplingParams(0.0, max_new_tokens=20)
    prompt = tuple(range(3, 40))
    engines = [ReferenceDecoder(CFG, CFG.kv_layout(page_tokens=16), 64) for _ in range(3)]
    want = decode_alone(engines[0], 99, list(prompt), params)

    demo = PddCore(config(6), record=True)
    sc = Scenario(
        prompt=prompt,
        params=params,
        policy=config(6).handoff,
        budget=config(6).budget,
        timeouts=TIMEOUTS,
        handoff_after=6,  # the main decode's KV lands once the relay streamed 6 tokens
        main_kv_delay=0.0,
    )

    async def go() -> Any:
        return await asyncio.wait_for(run_scenario(sc, *engines, core=demo), 30)

    res = asyncio.run(go())
    assert res.stream.tokens == want and res.relay is not None and res.main is not None
    assert len(res.relay.tokens) == 6 and res.main.switch_at == 6

    # the proxy's driver hears the same request from vLLM
    proxy = PddCore(config(6), record=True)
    h = HttpHandoff(proxy, 1, len(prompt), params.max_new_tokens)
    h.open(0.0)
    acts: list[Any] = []
    t = 0.0
    for tok in want[:8]:  # the relay's stream; what comes after its stop is dropped
        t += 0.01
        acts += h.relay_piece([tok], "", None, t)
    assert acts.count(StopRelay()) == 1
    acts = h.md_loaded(t + 0.1)
    cont = [a for a in acts if isinstance(a, Continue)]
    assert cont == [Continue(tuple(want[:6]), params.max_new_tokens - 6, settle=True)]
    for tok in want[6:]:
        t += 0.01
        acts += h.main_piece([tok], "", "length" if tok is want[-1] else None, t)
    assert [a for a in acts if isinstance(a, Done)] == [Done("length")]
    assert len([a for a in acts if isinstance(a, Continue)]) == 1  # one stream to the end

    a, b = decisions(demo.log), decisions(proxy.log)
    assert a == b, (a, b)
    # token 0's step, the switch's extend of 1..5, then one decode step per token
    assert [(x[0], len(x[1]), x[2]) for x in b["extend"][:3]] == [
        (0, 1, False),
        (1, 5, True),
        (6, 1, True),
    ]
    assert b["relay"] == [True, False] and len(b["extend"]) == 2 + 13  # not the last
    assert [p[0] for p in b["to_relay"]] == ["Ready", "Ack", "Ack"]
    assert [(p[0], p[1]["start"], p[1]["commit"]) for p in b["to_main"]] == [("Tokens", 1, True)]
    assert b["done"] == [(tuple(want), 0, 6)]


def shown(acts: list[Any]) -> list[int]:
    return [t for a in acts if isinstance(a, Show) for t in a.token_ids]


def test_proxy_catch_up_rounds_then_the_switch() -> None:
    core = PddCore(
        PddConfig(
            handoff=HandoffPolicy(threshold=2, force=Mode.CATCH_UP),
            budget=RelayBudget(token_budget=100, min_budget=1),
            timeouts=TIMEOUTS,
        ),
        record=True,
    )
    h = HttpHandoff(core, 7, 50, 40)
    h.open(0.0)
    toks = [100 + i for i in range(40)]
    acts: list[Any] = []
    for i in range(10):
        acts += h.relay_piece([toks[i]], f"<{i}>", None, 0.01 * i)
    acts += h.md_loaded(0.2)
    ext = [a for a in acts if isinstance(a, Extend)]
    assert ext == [Extend(tuple(toks[:10]), 9)]  # a round: tokens 1..9, the relay goes on
    assert StopRelay() not in acts
    for i in range(10, 14):  # the relay decodes while the main decode extends
        acts += h.relay_piece([toks[i]], f"<{i}>", None, 0.2 + 0.01 * i)
    acts += h.extended(9, 0.4)
    ext = [a for a in acts if isinstance(a, Extend)]
    assert ext[-1] == Extend(tuple(toks[:14]), 4)  # the gap of 4 > 2: one more round
    acts += h.relay_piece([toks[14]], "<14>", None, 0.41)
    acts += h.extended(4, 0.5)
    # the gap is 1: the commit; the relay's request goes and the main decode continues
    cont = [a for a in acts if isinstance(a, Continue)]
    assert cont == [Continue(tuple(toks[:15]), 40 - 15, settle=True)]
    assert acts.count(StopRelay()) == 1
    late = h.relay_piece([toks[15]], "<late>", None, 0.51)  # after the cancel: dropped
    assert shown(late) == []
    for i in range(15, 40):
        acts += h.main_piece([toks[i]], f"<{i}>", "length" if i == 39 else None, 0.6 + 0.01 * i)
    assert shown(acts) == toks
    text = "".join(a.text for a in acts if isinstance(a, Show))
    assert text == "".join(f"<{i}>" for i in range(40))
    assert h.mode == "catch_up" and h.rounds == 2 and h.switch_at == 15
    assert [a for a in acts if isinstance(a, Done)] == [Done("length")]


def test_proxy_relay_end_of_stream_and_failures() -> None:
    cfg = PddConfig(budget=RelayBudget(token_budget=100, min_budget=1), timeouts=TIMEOUTS)
    # EOS on the relay before the main decode is ready: the request ends there
    h = HttpHandoff(PddCore(cfg), 1, 10, 50)
    h.open(0.0)
    acts = h.relay_piece([5], "a", None, 0.0) + h.relay_piece([6], "b", "stop", 0.1)
    assert shown(acts) == [5, 6] and acts[-1] == Done("stop")
    # the relay fails before its first token: the main decode serves it all
    h = HttpHandoff(PddCore(cfg), 2, 10, 50)
    h.open(0.0)
    assert h.relay_failed(0.0) == [MainAlone()]
    # the relay fails after 3 tokens, before any handoff: the main decode takes
    # over from token 0 (the client drops the copies it has)
    h = HttpHandoff(PddCore(cfg), 3, 10, 8)
    h.open(0.0)
    acts = []
    for i in range(3):
        acts += h.relay_piece([10 + i], "", None, 0.01 * i)
    acts += h.relay_failed(0.1)
    acts += h.md_loaded(0.2)
    cont = [a for a in acts if isinstance(a, Continue)]
    assert cont == [Continue((10,), 7, settle=False)]
    for i in range(1, 8):
        acts += h.main_piece([10 + i], "", "length" if i == 7 else None, 0.3 + 0.01 * i)
    assert shown(acts) == [10 + i for i in range(8)]
    assert acts[-1] == Done("length")


def test_proxy_main_ready_before_the_relay_first_token() -> None:
    """The main decode's load is done before the relay's first token: the
    relay commits token 0 alone and the main decode switches at 1 with no
    extend in flight; the proxy stops the relay and continues on the main
    decode after token 0 (no request is left waiting for a decision)."""
    h = HttpHandoff(PddCore(config(6)), 1, 30, 10)
    h.open(0.0)
    assert h.md_loaded(0.1) == []
    acts = h.relay_piece([50], "a", None, 0.2)
    assert shown(acts) == [50]
    assert acts.count(StopRelay()) == 1
    assert [a for a in acts if isinstance(a, Continue)] == [Continue((50,), 9, settle=True)]
    assert shown(h.relay_piece([51], "b", None, 0.3)) == []  # after the cancel: dropped
    for i in range(1, 10):
        acts += h.main_piece([50 + i], "x", "length" if i == 9 else None, 0.4 + 0.01 * i)
    assert shown(acts) == [50 + i for i in range(10)]
    assert [a for a in acts if isinstance(a, Done)] == [Done("length")]
    assert h.switch_at == 1


def test_proxy_relay_start_does_not_restart_the_relay() -> None:
    """The relay's first token starts the core's relay side: the relay's
    request already runs, so the proxy is not told to start another one."""
    h = HttpHandoff(PddCore(config(6)), 1, 30, 20)
    h.open(0.0)
    acts: list[Any] = []
    for i in range(4):
        acts += h.relay_piece([60 + i], "", None, 0.01 * (i + 1))
    assert not [a for a in acts if isinstance(a, RestartRelay)]
    assert shown(acts) == [60, 61, 62, 63]
