"""Token-ID handoff between a relay decode and a main decode (sans-IO).

``messages`` holds the byte codecs, ``relay`` and ``main`` the two state
machines, ``policy`` the one-shot / catch-up choice and the token budget,
``stream`` the client's exactly-once merge.  ``driver`` (asyncio, imports
torch) runs the roles over a pluggable message channel.
"""

from __future__ import annotations

from .main import MainSide, MainState
from .messages import (
    Ack,
    Done,
    DoneReason,
    HandoffMessage,
    Kind,
    Ready,
    Source,
    StreamTokens,
    Tokens,
    decode,
    encode,
)
from .outputs import HandoffTimeouts, Output, ToClient, ToPeer
from .params import SamplingParams
from .policy import HandoffPolicy, Mode, catch_up_rounds
from .relay import RelaySide, RelayState
from .stream import StreamMerge

__all__ = [
    "Ack",
    "Done",
    "DoneReason",
    "HandoffMessage",
    "HandoffPolicy",
    "HandoffTimeouts",
    "Kind",
    "MainSide",
    "MainState",
    "Mode",
    "Output",
    "Ready",
    "RelaySide",
    "RelayState",
    "SamplingParams",
    "Source",
    "StreamMerge",
    "StreamTokens",
    "ToClient",
    "ToPeer",
    "Tokens",
    "catch_up_rounds",
    "decode",
    "encode",
]
