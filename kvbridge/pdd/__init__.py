"""The PDD orchestration core (sans-IO): the pipeline's route and dual-path
destinations, the relay's dynamic budget, one-shot or catch-up handoff and
the client's exactly-once merge, as events in and commands out.

``core`` holds :class:`PddCore`, ``events`` its events and commands,
``budget`` the relay's budget, load and step clock.  ``aio`` (asyncio)
drives the core for engines that meet the handoff engine contract over a
handoff message channel (the reference demo); the vLLM proxy drives it over
HTTP (:mod:`kvbridge.integrations.vllm.proxy`).
"""

from __future__ import annotations

from .budget import RelayBudget, RelayLoad, StepClock
from .core import PddConfig, PddCore
from .events import (
    Arrive,
    ClientOpen,
    ClientStream,
    Command,
    Deliver,
    Emit,
    Ended,
    Event,
    Finish,
    KVSent,
    MainExtend,
    MainExtended,
    MainKVReady,
    MainRun,
    MainStart,
    MainToken,
    PeerLost,
    PeerMessage,
    PrefillDone,
    RelayRun,
    RelayStart,
    RelayStats,
    RelayToken,
    Role,
    Route,
    SendHandoff,
    StreamDone,
    Tick,
)

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
    "PddConfig",
    "PddCore",
    "PeerLost",
    "PeerMessage",
    "PrefillDone",
    "RelayBudget",
    "RelayLoad",
    "RelayRun",
    "RelayStart",
    "RelayStats",
    "RelayToken",
    "Role",
    "Route",
    "SendHandoff",
    "StepClock",
    "StreamDone",
    "Tick",
]
