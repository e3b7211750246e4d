"""The PDD core's inputs (events) and outputs (commands): plain dataclasses.

A driver turns what happens on its transport into events (a request
arrived, a relay token was decoded, the main decode holds the prompt KV, a
handoff message came in, time passed) and carries out the commands that
:meth:`kvbridge.pdd.PddCore.handle` returns (send the KV here and there,
stop the relay, extend these token IDs on the main decode, show these
tokens to the client).  The reference demo drives the core over kvbridge's
protocol path, the vLLM proxy over HTTP; both hand it the same events.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..handoff.messages import Ack, Done, Ready, Source, StreamTokens, Tokens
from ..handoff.params import SamplingParams
from ..router import Decision, Pipeline

__all__ = [
    "Arrive",
    "ClientOpen",
    "ClientStream",
    "Command",
    "Deliver",
    "Emit",
    "Ended",
    "Event",
    "Finish",
    "KVSent",
    "MainExtend",
    "MainExtended",
    "MainKVReady",
    "MainRun",
    "MainStart",
    "MainToken",
    "PeerLost",
    "PeerMessage",
    "PrefillDone",
    "RelayRun",
    "RelayStart",
    "RelayStats",
    "RelayToken",
    "Role",
    "Route",
    "SendHandoff",
    "StreamDone",
    "Tick",
]


class Role(str, enum.Enum):
    RELAY = "relay"
    MAIN = "main"
    CLIENT = "client"


# ---- events ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrive:
    """A request reached the prefill.  ``matched_tokens``: what the main
    decode holds of its prompt (the PREFIX_REPLY, or the proxy's estimate);
    ``compute_tokens``: what the prefill computes (its prompt less its own
    prefix-cache hit); ``pipeline``: a fixed pipeline instead of the
    router's choice."""

    rid: int
    input_tokens: int
    matched_tokens: int
    max_new_tokens: int
    now: float
    compute_tokens: int | None = None
    pipeline: Pipeline | None = None


@dataclass(frozen=True)
class PrefillDone:
    """The prefill computed ``computed_tokens`` tokens in ``seconds``."""

    rid: int
    computed_tokens: int
    seconds: float
    now: float


@dataclass(frozen=True)
class KVSent:
    """The KV to ``dest`` ("md" or "rld") landed: ``nbytes`` in ``seconds``
    (``ok=False``: it failed)."""

    rid: int
    dest: str
    nbytes: int
    seconds: float
    now: float
    ok: bool = True


@dataclass(frozen=True)
class RelayStart:
    """The relay holds the prompt KV and output token 0.  ``eta_s``: when
    the main decode is expected ready, from now (None: the router's WAN
    estimate of the route, when this core routed the request)."""

    rid: int
    first_token: int
    params: SamplingParams
    now: float
    eta_s: float | None = None


@dataclass(frozen=True)
class RelayToken:
    """The relay decoded its next output token."""

    rid: int
    token: int
    now: float


@dataclass(frozen=True)
class RelayStats:
    """The relay engine's counters so far (its seconds per step)."""

    busy_s: float
    passes: int
    now: float


@dataclass(frozen=True)
class MainStart:
    """The main decode learned the request: prompt length, output token 0,
    sampling; ``relayed``: a relay streams the first tokens."""

    rid: int
    prompt_len: int
    first_token: int
    params: SamplingParams
    relayed: bool
    now: float


@dataclass(frozen=True)
class MainKVReady:
    """The prompt KV is in the main decode's pages."""

    rid: int
    now: float


@dataclass(frozen=True)
class MainExtended:
    """The main decode fed ``count`` tokens of the last :class:`MainExtend`."""

    rid: int
    count: int
    now: float


@dataclass(frozen=True)
class MainToken:
    """The main decode sampled its next output token."""

    rid: int
    token: int
    now: float


@dataclass(frozen=True)
class PeerMessage:
    """A handoff message from the other decode (READY / ACK for the relay,
    TOKENS / DONE for the main decode)."""

    rid: int
    message: Ready | Tokens | Ack | Done
    now: float


@dataclass(frozen=True)
class PeerLost:
    """``role``'s messages to the other decode cannot be sent."""

    rid: int
    role: Role
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed: fire the deadlines that are due (of request ``rid``
    only, and of its ``role``'s side only, when given)."""

    now: float
    rid: int | None = None
    role: Role | None = None


@dataclass(frozen=True)
class ClientOpen:
    """The client waits for the request's stream."""

    rid: int
    now: float


@dataclass(frozen=True)
class ClientStream:
    """Stream tokens reached the client."""

    message: StreamTokens
    now: float


@dataclass(frozen=True)
class Finish:
    """The driver is done with the request (``role``: with that role's part
    of it only): drop what the core keeps of it."""

    rid: int
    now: float
    role: Role | None = None


Event = (
    Arrive
    | PrefillDone
    | KVSent
    | RelayStart
    | RelayToken
    | RelayStats
    | MainStart
    | MainKVReady
    | MainExtended
    | MainToken
    | PeerMessage
    | PeerLost
    | Tick
    | ClientOpen
    | ClientStream
    | Finish
)


# ---- commands -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """The request's pipeline and where the prefill sends its KV at once
    (the dual-path send): ``destinations`` of "md" and "rld".  ``eta_s``:
    the WAN part the router expects (the relay's budget covers it);
    ``cancel_main``: P-RLD, the main decode's lease on the prompt goes."""

    rid: int
    pipeline: Pipeline
    reason: str
    destinations: tuple[str, ...]
    relayed: bool
    eta_s: float
    cancel_main: bool = False
    decision: Decision | None = None


@dataclass(frozen=True)
class SendHandoff:
    """Send a handoff message to the other decode (``to``)."""

    rid: int
    to: Role
    message: Ready | Tokens | Ack | Done


@dataclass(frozen=True)
class Emit:
    """Send these stream tokens to the client."""

    rid: int
    message: StreamTokens


@dataclass(frozen=True)
class RelayRun:
    """``run``: the relay decodes (again); False: it stops decoding (at its
    budget, after the commit, or when the main decode took over)."""

    rid: int
    run: bool


@dataclass(frozen=True)
class MainExtend:
    """The main decode feeds output tokens ``[start, start + len(tokens))``
    in one extend step and answers :class:`MainExtended`.  ``switch``: after
    this extend the main decode owns the stream (it then samples the next
    token: a driver may make the extend and the decode one call)."""

    rid: int
    start: int
    tokens: tuple[int, ...]
    switch: bool


@dataclass(frozen=True)
class MainRun:
    """``run``: the main decode samples its output tokens (it owns the
    stream); False: it stops."""

    rid: int
    run: bool


@dataclass(frozen=True)
class Deliver:
    """The client's merge delivers tokens ``[start, start + len(tokens))``,
    each once and in order, as the first copy came from ``source``."""

    rid: int
    start: int
    tokens: tuple[int, ...]
    source: Source


@dataclass(frozen=True)
class StreamDone:
    """The client's stream is complete.  ``switch_at``: the first position
    the main decode streamed after relay tokens (None: no switch);
    ``switch_gap_s``: the longest pause between tokens around it."""

    rid: int
    tokens: tuple[int, ...]
    duplicates: int
    conflicts: int
    switch_at: int | None
    switch_gap_s: float | None


@dataclass(frozen=True)
class Ended:
    """``role``'s part of the request is over (its state's name)."""

    rid: int
    role: Role
    state: str


Command = (
    Route | SendHandoff | Emit | RelayRun | MainExtend | MainRun | Deliver | StreamDone | Ended
)
