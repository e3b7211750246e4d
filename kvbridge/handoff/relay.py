"""The relay decode's side of the handoff (sans-IO state machine).

The relay emits every token it generates to the client at once (eager
tokens).  When the main decode says READY, the relay hands over token IDs:
one-shot (one TOKENS message with the commit) or catch-up (rounds of TOKENS,
each acknowledged, while it keeps decoding, then the commit).  The commit
stops the relay's emission at ``commit_at``: the relay has emitted exactly
the tokens ``[0, commit_at)`` and never emits again unless the main decode
is declared dead.  The switch is complete when the main decode answers
``ACK(switched, switch_at)``.

The driver feeds events (``start``, ``on_token``, ``on_message``, ``poll``)
with the current time and carries out the returned outputs; it runs a decode
step while :attr:`RelaySide.want_decode` is true.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from ..errors import InvalidArgument, RemoteProtocolError
from .messages import Ack, Done, DoneReason, HandoffMessage, Ready, Source, StreamTokens, Tokens
from .outputs import HandoffTimeouts, Output, ToClient, ToPeer
from .params import SamplingParams
from .policy import HandoffPolicy, Mode

__all__ = ["RelaySide", "RelayState"]


class RelayState(enum.Enum):
    IDLE = "idle"  # no first token yet
    DECODING = "decoding"  # emitting eager tokens (a catch-up round may be in flight)
    CAPPED = "capped"  # at the token budget: no decoding, waiting to hand over
    COMMITTING = "committing"  # commit sent, emission stopped, waiting for the switch ACK
    SWITCHED = "switched"  # the main decode owns the stream
    DEGRADED = "degraded"  # main decode dead or slow: the relay decodes to the end
    FINISHED = "finished"  # the relay emitted the whole output


class RelaySide:
    """One request on the relay decode."""

    def __init__(
        self,
        request_id: int,
        params: SamplingParams,
        policy: HandoffPolicy | None = None,
        timeouts: HandoffTimeouts | None = None,
        budget: Callable[[int, float], int] | None = None,
    ) -> None:
        self.request_id = request_id
        self._budget = budget
        self.params = params
        self.policy = policy or HandoffPolicy()
        self.timeouts = timeouts or HandoffTimeouts()
        self.state = RelayState.IDLE
        self.tokens: list[int] = []
        self.load = 0.0
        self.mode: Mode | None = None
        self.main_ready = False
        self.acked = 0  # the main decode holds tokens [0, acked)
        self.rounds = 0  # catch-up rounds sent (not counting the commit)
        self.gaps: list[int] = []  # tokens handed in each message, commit last
        self.commit_at: int | None = None
        self.in_flight: Tokens | None = None
        self.retries = 0
        self.eta: float | None = None  # when the main decode is expected ready
        # the main decode failed (gone, silent or too late): the relay keeps the
        # request to its end (False again if the main decode switches after all)
        self.kept = False
        self.peer_lost = False  # a message to the main decode could not be sent
        self._round_deadline: float | None = None
        self._cap_deadline: float | None = None

    # ---- queries ---------------------------------------------------------------
    @property
    def want_decode(self) -> bool:
        """Whether the driver should run the next decode step now."""
        return self.state in (RelayState.DECODING, RelayState.DEGRADED)

    @property
    def done(self) -> bool:
        """Nothing more to do for the request on the relay (free it)."""
        return self.state in (RelayState.SWITCHED, RelayState.FINISHED)

    @property
    def next_index(self) -> int:
        """The output index of the next token the relay would generate."""
        return len(self.tokens)

    def next_deadline(self) -> float | None:
        ds = [d for d in (self._round_deadline, self._cap_deadline) if d is not None]
        return min(ds) if ds else None

    def set_load(self, load: float) -> None:
        """The relay's live load (0..1), read by the policy."""
        self.load = load

    def set_eta(self, eta: float) -> None:
        """The main decode is expected ready at ``eta`` (same clock as ``now``):
        at the cap the relay waits for READY until ``capped_wait`` past it."""
        self.eta = eta

    def budget(self, now: float) -> int:
        """How many tokens the relay may generate: ``budget(produced, now)``
        as given (the PDD core's dynamic budget, :mod:`kvbridge.pdd.budget`),
        else all but the last token (only a failed main decode lets the
        relay finish a request)."""
        if self._budget is not None:
            return max(1, self._budget(len(self.tokens), now))
        return max(1, self.params.max_new_tokens - 1)

    # ---- events ----------------------------------------------------------------
    def start(self, first_token: int, now: float) -> list[Output]:
        """The prompt KV has landed with the first output token (index 0)."""
        if self.state is RelayState.IDLE:
            self.state = RelayState.DECODING
        elif self.state is not RelayState.DEGRADED or self.tokens:
            raise InvalidArgument("relay request already started")
        return self._append(first_token, now)

    def on_token(self, token: int, now: float) -> list[Output]:
        """The driver decoded output token :attr:`next_index`."""
        if not self.want_decode:
            raise InvalidArgument(f"relay is {self.state.value}: it must not decode")
        return self._append(token, now)

    def on_message(self, msg: HandoffMessage, now: float) -> list[Output]:
        """A READY or ACK from the main decode."""
        if msg.request_id != self.request_id:
            raise InvalidArgument(
                f"message for request {msg.request_id} given to {self.request_id}"
            )
        if not isinstance(msg, (Ready, Ack)):
            raise RemoteProtocolError(f"the relay does not accept {type(msg).__name__}")
        if self.state is RelayState.FINISHED:
            return [ToPeer(Done(self.request_id, DoneReason.FINISHED, len(self.tokens)))]
        if self.state is RelayState.SWITCHED:
            return []
        self.acked = max(self.acked, min(msg.held, len(self.tokens)))
        if isinstance(msg, Ack) and msg.switched:
            # The main decode emits from switch_at on: after our commit, or on its
            # own after it took us for dead.  Either way we stop, and the request
            # ends on the main decode (even if we had taken it for failed).
            self.kept = False
            self._stop(RelayState.SWITCHED)
            return []
        if self.state is RelayState.DEGRADED:
            return [ToPeer(Done(self.request_id, DoneReason.KEPT, len(self.tokens)))]
        if self.state is RelayState.IDLE:
            return []  # cannot hand over before our own first token; READY is resent
        if isinstance(msg, Ready) and not self.main_ready:
            self.main_ready = True
            self.mode = self.policy.choose(self.load)
            self._cap_deadline = None
        if (
            self.in_flight is not None
            and not self.in_flight.commit
            and self.acked >= self.in_flight.end
        ):
            self.in_flight = None  # the round is complete
            self._round_deadline = None
        if (
            self.main_ready
            and self.in_flight is None
            and self.state in (RelayState.DECODING, RelayState.CAPPED)
        ):
            return self._hand_over(now)
        return []

    def peer_gone(self, now: float) -> list[Output]:
        """A message to the main decode could not be sent: its connections are
        gone.  That is the main decode's failure, not the relay's: before the
        switch the relay decodes to the end (DEGRADED) and keeps the request.
        The DONE(KEPT) it returns is for a main decode that comes back."""
        self.peer_lost = True
        if self.state in (
            RelayState.IDLE,
            RelayState.DECODING,
            RelayState.CAPPED,
            RelayState.COMMITTING,
        ):
            return self._degrade()
        return []

    def poll(self, now: float) -> list[Output]:
        """Fire the deadlines that have passed."""
        out: list[Output] = []
        if (
            self._round_deadline is not None
            and now >= self._round_deadline
            and self.in_flight is not None
        ):
            if self.retries < self.timeouts.max_retries:
                self.retries += 1
                self._round_deadline = now + self.timeouts.ack_wait(len(self.in_flight.tokens))
                out.append(ToPeer(self.in_flight))
            else:
                out += self._degrade()
        if (
            self._cap_deadline is not None
            and now >= self._cap_deadline
            and self.state is RelayState.CAPPED
        ):
            out += self._degrade()
        return out

    # ---- internals ---------------------------------------------------------------
    def _append(self, token: int, now: float) -> list[Output]:
        i = len(self.tokens)
        self.tokens.append(token)
        last = self.params.is_last(i, token)
        out: list[Output] = [
            ToClient(StreamTokens(self.request_id, i, (token,), Source.RELAY, last))
        ]
        if last:
            self._stop(RelayState.FINISHED)
            out.append(ToPeer(Done(self.request_id, DoneReason.FINISHED, len(self.tokens))))
            return out
        if self.state is RelayState.DECODING and len(self.tokens) >= self.budget(now):
            self.state = RelayState.CAPPED
            if self.main_ready and self.in_flight is None:
                out += self._hand_over(now)
            elif not self.main_ready:
                start = now if self.eta is None else max(now, self.eta)
                self._cap_deadline = start + self.timeouts.capped_wait
        return out

    def _hand_over(self, now: float) -> list[Output]:
        assert self.mode is not None
        gap = len(self.tokens) - self.acked
        prev = self.gaps[-1] if self.gaps else None
        commit = self.state is RelayState.CAPPED or self.policy.should_commit(
            self.mode, gap, self.rounds, prev
        )
        msg = Tokens(
            self.request_id,
            self.acked,
            tuple(self.tokens[self.acked :]),
            self.params,
            commit=commit,
            round=self.rounds,
        )
        self.gaps.append(gap)
        if commit:
            self.state = RelayState.COMMITTING
            self.commit_at = len(self.tokens)
        else:
            self.rounds += 1
        self.in_flight = msg
        self.retries = 0
        self._round_deadline = now + self.timeouts.ack_wait(len(msg.tokens))
        return [ToPeer(msg)]

    def _degrade(self) -> list[Output]:
        self.kept = True
        self._stop(RelayState.DEGRADED)
        return [ToPeer(Done(self.request_id, DoneReason.KEPT, len(self.tokens)))]

    def _stop(self, state: RelayState) -> None:
        self.state = state
        self.in_flight = None
        self._round_deadline = None
        self._cap_deadline = None
