"""The proxy's P-RLD-MD request as the PDD core sees it (sans-IO).

:class:`HttpHandoff` turns what the proxy hears from vLLM over HTTP (the
relay's streamed pieces, the main decode's prompt load, an extend's answer,
the main decode's streamed pieces, a failure) into the core's events, and
the core's commands into what the proxy must do next (:data:`Action`): show
tokens to the client, cancel the relay's request (the core stopped it at
its budget, or handed over), restart it (the main decode failed), extend a
batch of token IDs on the main decode (a catch-up round: a one-token request
whose prompt blocks hit the pinned prompt KV), or continue the stream on
the main decode after the switch.  The proxy does the HTTP; every decision
is the core's, as it is the reference demo's (:mod:`kvbridge.pdd.aio`).

On vLLM the relay computes output token 0 itself; the prompt KV of the main
decode is loaded (and pinned) by a separate request.  An extend of output
token 0 alone is acknowledged at once: the next extend's request computes
it with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...handoff import SamplingParams, Source
from ...pdd import (
    ClientOpen,
    ClientStream,
    Deliver,
    Emit,
    Ended,
    Event,
    MainExtend,
    MainExtended,
    MainKVReady,
    MainRun,
    MainStart,
    MainToken,
    PddCore,
    PeerLost,
    PeerMessage,
    RelayRun,
    RelayStart,
    RelayToken,
    Role,
    SendHandoff,
    StreamDone,
    Tick,
)

__all__ = [
    "Action",
    "Continue",
    "Done",
    "Extend",
    "HttpHandoff",
    "MainAlone",
    "RestartRelay",
    "Show",
    "StopRelay",
]


@dataclass(frozen=True)
class Show:
    """Send these tokens (and text) to the client."""

    token_ids: tuple[int, ...]
    text: str
    source: str  # "relay" or "main"


@dataclass(frozen=True)
class StopRelay:
    """Cancel the relay's request (closing its stream aborts it)."""


@dataclass(frozen=True)
class RestartRelay:
    """The relay decodes again after ``prefix`` (the main decode failed)."""

    prefix: tuple[int, ...]


@dataclass(frozen=True)
class Extend:
    """A catch-up round: the main decode computes the KV of output tokens
    ``ids[-count:]`` (its prompt is the request's prompt plus ``ids``);
    answer :meth:`HttpHandoff.extended`."""

    ids: tuple[int, ...]
    count: int


@dataclass(frozen=True)
class Continue:
    """The switch: the main decode gets the prompt plus ``ids`` (output
    tokens ``[0, len(ids))``) and streams up to ``max_tokens`` more.
    ``settle``: the relay showed exactly these tokens; its text may hold
    back the end of the last one."""

    ids: tuple[int, ...]
    max_tokens: int
    settle: bool


@dataclass(frozen=True)
class MainAlone:
    """The relay failed before its first token: the main decode serves the
    whole request once its load is done."""


@dataclass(frozen=True)
class Done:
    """The client's stream ends (``reason``: vLLM's finish reason)."""

    reason: str


Action = Show | StopRelay | RestartRelay | Extend | Continue | MainAlone | Done


@dataclass
class HttpHandoff:
    """One P-RLD-MD request of the proxy, on the proxy's :class:`PddCore`."""

    core: PddCore
    rid: int
    prompt_len: int
    max_tokens: int
    started: bool = False
    main_kv: bool = False
    switch_len: int = 0  # tokens of the switch extend that the main stream carries
    relay_text: str = ""  # text of the relay tokens shown
    relay_shown: int = 0
    finished: str | None = None
    extends: int = 0
    switch_at: int | None = None
    switch_gap_s: float | None = None
    mode: str | None = None
    rounds: int = 0
    budget: int | None = None
    cut_at: float | None = None
    handoff_s: float | None = None
    relay_stopped: bool = False
    streaming: bool = False  # the main decode streams the rest itself
    _texts: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.params = SamplingParams(max_new_tokens=self.max_tokens)

    def open(self, now: float) -> None:
        self.core.handle(ClientOpen(self.rid, now))

    # ---- what the proxy heard ------------------------------------------------------------
    def relay_piece(
        self, ids: list[int], text: str, finish: str | None, now: float
    ) -> list[Action]:
        events: list[Event] = []
        pending = text
        for tok in ids:
            if not self.started:
                self.started = True
                events += [
                    RelayStart(self.rid, tok, self.params, now),
                    MainStart(self.rid, self.prompt_len, tok, self.params, True, now),
                ]
                if self.main_kv:
                    events.append(MainKVReady(self.rid, now))
                self._texts[0], pending = pending, ""
            else:
                events.append(RelayToken(self.rid, tok, now))
        acts = self._drive(events, now, pending)
        side = self.core.relay(self.rid)
        if finish == "stop" and side is not None and side.want_decode and self.finished is None:
            # EOS or a stop string before the handoff: the request ends here
            self.finished = "stop"
            acts.append(Done("stop"))
        return acts

    def relay_failed(self, now: float) -> list[Action]:
        if not self.started:
            return [MainAlone()]
        return self._drive([PeerLost(self.rid, Role.MAIN, now)], now)  # the main takes over

    def md_loaded(self, now: float) -> list[Action]:
        self.main_kv = True
        if not self.started:
            return []
        return self._drive([MainKVReady(self.rid, now)], now)

    def extended(self, count: int, now: float) -> list[Action]:
        self.extends += 1
        return self._drive([MainExtended(self.rid, count, now)], now)

    def main_piece(self, ids: list[int], text: str, finish: str | None, now: float) -> list[Action]:
        events: list[Event] = []
        if self.switch_len and ids:
            events.append(MainExtended(self.rid, self.switch_len, now))
            self.switch_len = 0
            if self.cut_at is not None:
                self.handoff_s = now - self.cut_at
        events += [MainToken(self.rid, tok, now) for tok in ids]
        acts = self._drive(events, now, text)
        if finish and self.finished is None:
            self.finished = finish
            acts.append(Done(finish))
        return acts

    def main_ended(self, now: float) -> list[Action]:
        if self.finished is not None:
            return []
        self.finished = "length"  # the backend's stream ended without a reason
        return [Done("length")]

    def tick(self, now: float) -> list[Action]:
        return self._drive([Tick(now, self.rid)], now)

    def next_deadline(self) -> float | None:
        return self.core.next_deadline()

    # ---- the core decides ----------------------------------------------------------------
    def _drive(self, events: list[Event], now: float, text: str = "") -> list[Action]:
        acts: list[Action] = []
        core, rid = self.core, self.rid
        complete = False
        while events:
            ev = events.pop(0)
            if isinstance(ev, RelayToken):
                side = core.relay(rid)
                if side is None or not side.want_decode:
                    continue  # came after the core stopped the relay: dropped
                self._texts[side.next_index], text = text, ""
            elif isinstance(ev, MainToken):
                m = core.main(rid)
                if m is None or not m.want_token:
                    continue  # past the end the core knows (max tokens)
                self._texts[m.next_index], text = text, ""
            for c in core.handle(ev):
                if isinstance(c, Emit):
                    events.append(ClientStream(c.message, now))
                elif isinstance(c, SendHandoff):
                    events.append(PeerMessage(rid, c.message, now))
                elif isinstance(c, Deliver):
                    src = "relay" if c.source is Source.RELAY else "main"
                    txt = "".join(self._texts.pop(c.start + i, "") for i in range(len(c.tokens)))
                    if src == "relay":
                        self.relay_text += txt
                        self.relay_shown += len(c.tokens)
                    acts.append(Show(c.tokens, txt, src))
                elif isinstance(c, StreamDone):
                    self.switch_at, self.switch_gap_s = c.switch_at, c.switch_gap_s
                    if self.finished is None:
                        self.finished = "length"
                        complete = True
                elif isinstance(c, RelayRun):
                    side = core.relay(rid)
                    if not c.run:
                        self.budget = None if side is None else len(side.tokens)
                        self.relay_stopped = True
                        acts.append(StopRelay())
                    elif self.relay_stopped:  # at its start the relay's request already runs
                        self.relay_stopped = False
                        acts.append(RestartRelay(tuple(side.tokens) if side else ()))
                elif isinstance(c, MainRun):
                    m = core.main(rid)
                    if c.run and not self.streaming and m is not None and not m.to_extend:
                        # the switch with no extend in flight (the relay committed
                        # nothing the main decode lacks, e.g. it was ready at token
                        # 0): the main decode's stream continues after what it holds
                        self.streaming = True
                        self.cut_at = now
                        if not self.relay_stopped:
                            self.relay_stopped = True
                            acts.append(StopRelay())
                        acts.append(
                            Continue(
                                tuple(m.known[: m.fed]),
                                self.max_tokens - m.fed,
                                settle=self.relay_shown == m.fed,
                            )
                        )
                elif isinstance(c, MainExtend):
                    m = core.main(rid)
                    assert m is not None
                    end = c.start + len(c.tokens)
                    if self.streaming:  # a decode step of vLLM's own stream
                        events.append(MainExtended(rid, len(c.tokens), now))
                    elif c.switch:
                        self.streaming = True
                        self.cut_at = now
                        self.switch_len = len(c.tokens)
                        if not self.relay_stopped:
                            self.relay_stopped = True
                            acts.append(StopRelay())
                        acts.append(
                            Continue(
                                tuple(m.known[:end]),
                                self.max_tokens - end,
                                settle=self.relay_shown == end,
                            )
                        )
                    elif c.start == 0 and len(c.tokens) == 1:
                        events.append(MainExtended(rid, 1, now))
                    else:
                        acts.append(Extend(tuple(m.known[:end]), len(c.tokens)))
                elif isinstance(c, Ended) and c.role is Role.RELAY:
                    side = core.relay(rid)
                    if side is not None:
                        self.mode = side.mode.value if side.mode else None
                        self.rounds = side.rounds
        if complete:
            acts.append(Done("length"))
        return acts
