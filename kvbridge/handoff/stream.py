"""The client's exactly-once merge of one request's output stream.

Tokens arrive from the relay and from the main decode as STREAM messages
with output positions.  The merge delivers each position once, in order:
copies of a delivered or buffered position are dropped (and counted; a copy
with a different token is counted as a conflict), positions after a gap wait
in a bounded buffer.  Deadlines: a gap that stays open for ``gap_timeout``,
or no new token for ``idle_timeout``, raises :class:`HandoffTimeout`.
"""

from __future__ import annotations

from ..errors import HandoffTimeout, InvalidArgument, RemoteProtocolError
from .messages import StreamTokens

__all__ = ["StreamMerge"]


class StreamMerge:
    """Merge of one request's STREAM messages into its output tokens."""

    def __init__(
        self,
        request_id: int,
        *,
        gap_timeout: float = 5.0,
        idle_timeout: float = 30.0,
        max_ahead: int = 1 << 16,
        now: float = 0.0,
    ) -> None:
        if gap_timeout <= 0 or idle_timeout <= 0 or max_ahead <= 0:
            raise InvalidArgument("timeouts and max_ahead must be positive")
        self.request_id = request_id
        self.gap_timeout = gap_timeout
        self.idle_timeout = idle_timeout
        self.max_ahead = max_ahead
        self.tokens: list[int] = []  # delivered, in order
        self.duplicates = 0
        self.conflicts = 0
        self.last_index: int | None = None
        self._pending: dict[int, int] = {}
        self._gap_since: float | None = None
        self._last_progress = now

    @property
    def done(self) -> bool:
        return self.last_index is not None and len(self.tokens) > self.last_index

    def push(self, msg: StreamTokens, now: float) -> list[int]:
        """Add a STREAM message; return the tokens it makes deliverable."""
        if msg.request_id != self.request_id:
            raise InvalidArgument(
                f"stream message for request {msg.request_id} given to {self.request_id}"
            )
        if msg.end - 1 - len(self.tokens) >= self.max_ahead:
            raise RemoteProtocolError(
                f"request {self.request_id}: position {msg.end - 1} is more than {self.max_ahead} ahead"
            )
        if msg.last and msg.tokens:
            last = msg.end - 1
            if self.last_index is not None and self.last_index != last:
                raise RemoteProtocolError(
                    f"request {self.request_id}: the stream ends at {self.last_index} and at {last}"
                )
            self.last_index = last
        for i, tok in enumerate(msg.tokens):
            pos = msg.start + i
            if self.last_index is not None and pos > self.last_index:
                raise RemoteProtocolError(f"request {self.request_id}: token {pos} after the end")
            seen = self.tokens[pos] if pos < len(self.tokens) else self._pending.get(pos)
            if seen is None:
                self._pending[pos] = tok
            else:
                self.duplicates += 1
                self.conflicts += seen != tok
        start = len(self.tokens)
        while len(self.tokens) in self._pending:
            self.tokens.append(self._pending.pop(len(self.tokens)))
        if len(self.tokens) > start:
            self._last_progress = now
        self._gap_since = (
            (self._gap_since if self._gap_since is not None else now) if self._pending else None
        )
        return self.tokens[start:]

    def next_deadline(self) -> float | None:
        if self.done:
            return None
        idle = self._last_progress + self.idle_timeout
        return idle if self._gap_since is None else min(idle, self._gap_since + self.gap_timeout)

    def check(self, now: float) -> None:
        """Raise :class:`HandoffTimeout` if a deadline has passed."""
        if self.done:
            return
        if self._gap_since is not None and now - self._gap_since >= self.gap_timeout:
            raise HandoffTimeout(
                f"request {self.request_id}: token {len(self.tokens)} missing for {now - self._gap_since:.3f} s"
            )
        if now - self._last_progress >= self.idle_timeout:
            raise HandoffTimeout(
                f"request {self.request_id}: no token for {now - self._last_progress:.3f} s"
            )
