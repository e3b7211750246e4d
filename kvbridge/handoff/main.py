"""The main decode's side of the handoff (sans-IO state machine).

The main decode learns the request (prompt length, first token, sampling
parameters) with the prompt KV.  When the KV has landed it says READY and
applies the relay's TOKENS messages by position: tokens it already holds are
checked and skipped, a message that starts beyond what it holds waits in a
small buffer until the gap is filled.  It extends every new token at once
(:attr:`MainSide.to_extend`) and acknowledges after the extend.  On the
commit it switches: it emits the stream from ``switch_at`` (the relay emitted
``[0, switch_at)``) and answers ``ACK(switched, switch_at)``.

If the relay stays silent for ``relay_timeout`` the main decode takes over
with what it holds: it re-sends the tokens ``[0, held)`` to the client (the
client drops the copies it has) and continues from ``held``.  A main decode
that has switched or taken over finishes the request whatever it hears.
"""

from __future__ import annotations

import enum

from ..errors import InvalidArgument, RemoteProtocolError
from .messages import Ack, Done, DoneReason, HandoffMessage, Ready, Source, StreamTokens, Tokens
from .outputs import HandoffTimeouts, Output, ToClient, ToPeer
from .params import SamplingParams

__all__ = ["MainSide", "MainState"]

MAX_BUFFERED = 64  # out-of-order TOKENS messages kept per request


class MainState(enum.Enum):
    WAITING_KV = "waiting_kv"  # the prompt KV is still crossing the WAN
    HOLDING = "holding"  # READY sent; applying the relay's tokens
    EMITTING = "emitting"  # the main decode owns the stream
    FINISHED = "finished"  # the whole output was emitted
    DROPPED = "dropped"  # the relay finished or kept the request


class MainSide:
    """One request on the main decode.  ``relay=False`` is the P-MD pipeline:
    no relay, the main decode emits from the first token."""

    def __init__(
        self,
        request_id: int,
        params: SamplingParams,
        prompt_len: int,
        first_token: int,
        timeouts: HandoffTimeouts | None = None,
        *,
        relay: bool = True,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt_len = prompt_len
        self.timeouts = timeouts or HandoffTimeouts()
        self.relay = relay
        self.state = MainState.WAITING_KV
        self.known: list[int] = [first_token]  # output tokens [0, len(known))
        self.fed = 0  # tokens whose KV is in the cache
        self.commit_end: int | None = None
        self.switch_at: int | None = None
        self.took_over = False
        self._buffer: dict[int, Tokens] = {}
        self._heard = False
        self.relay_lost = False  # a message to the relay could not be sent
        self._ready_deadline: float | None = None
        self._relay_deadline: float | None = None

    # ---- queries ---------------------------------------------------------------
    @property
    def to_extend(self) -> list[int]:
        """Tokens the driver must feed to the engine now (one: a decode step)."""
        if self.state in (MainState.HOLDING, MainState.EMITTING):
            return self.known[self.fed :]
        return []

    @property
    def want_token(self) -> bool:
        """Whether the driver should sample output token :attr:`next_index`."""
        return self.state is MainState.EMITTING and self.fed == len(self.known)

    @property
    def next_index(self) -> int:
        return len(self.known)

    @property
    def done(self) -> bool:
        return self.state in (MainState.FINISHED, MainState.DROPPED)

    def next_deadline(self) -> float | None:
        if self.state is not MainState.HOLDING:
            return None
        ds = [d for d in (self._ready_deadline, self._relay_deadline) if d is not None]
        return min(ds) if ds else None

    # ---- events ----------------------------------------------------------------
    def on_kv_ready(self, now: float) -> list[Output]:
        """The prompt KV is in the engine's pages."""
        if self.state is not MainState.WAITING_KV:
            return []
        if not self.relay:
            return self._take_over(0)
        if self.relay_lost:
            return self._take_over(len(self.known))
        self.state = MainState.HOLDING
        self._ready_deadline = now + self.timeouts.ready_retry
        self._relay_deadline = now + self.timeouts.relay_timeout
        out: list[Output] = [ToPeer(self._ready())]
        return out + self._apply(now)

    def on_extended(self, count: int, now: float) -> list[Output]:
        """The driver fed ``count`` tokens of :attr:`to_extend` to the engine."""
        if not 0 < count <= len(self.known) - self.fed:
            raise InvalidArgument(f"extended {count} tokens, {len(self.known) - self.fed} pending")
        self.fed += count
        if self.state is MainState.HOLDING and self.fed == len(self.known):
            return self._progress(now)
        return []

    def on_token(self, token: int, now: float) -> list[Output]:
        """The driver sampled output token :attr:`next_index`."""
        if not self.want_token:
            raise InvalidArgument(f"main decode is {self.state.value}: it must not sample")
        i = len(self.known)
        self.known.append(token)
        last = self.params.is_last(i, token)
        if last:
            self.state = MainState.FINISHED
        return [ToClient(StreamTokens(self.request_id, i, (token,), Source.MAIN, last))]

    def on_message(self, msg: HandoffMessage, now: float) -> list[Output]:
        """A TOKENS or DONE from the relay."""
        if msg.request_id != self.request_id:
            raise InvalidArgument(
                f"message for request {msg.request_id} given to {self.request_id}"
            )
        if isinstance(msg, Done):
            if self.state in (MainState.WAITING_KV, MainState.HOLDING) or (
                msg.reason is DoneReason.FINISHED and self.state is MainState.EMITTING
            ):
                self.state = MainState.DROPPED
            return []
        if not isinstance(msg, Tokens):
            raise RemoteProtocolError(f"the main decode does not accept {type(msg).__name__}")
        if msg.params != self.params:
            raise RemoteProtocolError(
                f"TOKENS for request {self.request_id} with other sampling parameters"
            )
        if self.state in (MainState.EMITTING, MainState.FINISHED):
            return [ToPeer(self._ack())]  # a late or repeated message: tell the relay again
        if self.state is MainState.DROPPED:
            return []
        self._heard = True
        self._ready_deadline = None
        self._relay_deadline = now + self.timeouts.relay_timeout
        old = self._buffer.get(msg.start)
        if old is None or msg.end > old.end or (msg.commit and not old.commit):
            self._buffer[msg.start] = msg
        if len(self._buffer) > MAX_BUFFERED:
            del self._buffer[max(self._buffer)]
        if self.state is MainState.WAITING_KV:
            return []
        before = len(self.known)
        out = self._apply(now)
        if len(self.known) == before and self.fed == len(self.known):
            out += self._progress(now)  # nothing new: answer at once
        return out

    def peer_gone(self, now: float) -> list[Output]:
        """A message to the relay could not be sent: its connections are gone.
        Before the switch the main decode takes over with what it holds (at
        once if it holds the prompt KV, else when the KV lands)."""
        self.relay_lost = True
        if self.state is MainState.HOLDING:
            return self._take_over(len(self.known))
        return []

    def poll(self, now: float) -> list[Output]:
        """Fire the deadlines that have passed."""
        if self.state is not MainState.HOLDING:
            return []
        if self._relay_deadline is not None and now >= self._relay_deadline:
            return self._take_over(len(self.known))
        if not self._heard and self._ready_deadline is not None and now >= self._ready_deadline:
            self._ready_deadline = now + self.timeouts.ready_retry
            return [ToPeer(self._ready())]
        return []

    # ---- internals ---------------------------------------------------------------
    def _ready(self) -> Ready:
        return Ready(self.request_id, self.prompt_len, len(self.known))

    def _ack(self) -> Ack:
        if self.switch_at is not None:
            return Ack(self.request_id, len(self.known), True, self.switch_at)
        return Ack(self.request_id, len(self.known))

    def _apply(self, now: float) -> list[Output]:
        """Apply buffered TOKENS that touch what we hold, in position order."""
        while True:
            ready = [s for s in self._buffer if s <= len(self.known)]
            if not ready:
                return []
            msg = self._buffer.pop(min(ready))
            have = len(self.known)
            overlap = self.known[msg.start : min(have, msg.end)]
            if list(msg.tokens[: len(overlap)]) != overlap:
                raise RemoteProtocolError(
                    f"request {self.request_id}: relay tokens disagree with held tokens at {msg.start}"
                )
            self.known.extend(msg.tokens[len(overlap) :])
            if msg.commit:
                self.commit_end = msg.end
                self._buffer.clear()
                return []

    def _progress(self, now: float) -> list[Output]:
        """All known tokens are extended: acknowledge, and switch on the commit."""
        self._relay_deadline = now + self.timeouts.relay_timeout  # the relay answers our ACK
        if self.commit_end is not None and self.fed >= self.commit_end:
            self.switch_at = self.commit_end
            self.state = MainState.EMITTING
            self._ready_deadline = self._relay_deadline = None
        return [ToPeer(self._ack())]

    def _take_over(self, at: int) -> list[Output]:
        """Emit from ``at`` on, re-sending ``[0, at)`` so that the client misses nothing."""
        self.switch_at = at
        self.took_over = self.relay
        self.state = MainState.EMITTING
        self._ready_deadline = self._relay_deadline = None
        last = any(self.params.is_last(i, t) for i, t in enumerate(self.known))
        if last:
            self.state = MainState.FINISHED
        out: list[Output] = [
            ToClient(StreamTokens(self.request_id, 0, tuple(self.known), Source.MAIN, last))
        ]
        if self.relay:
            out.append(ToPeer(self._ack()))
        return out
