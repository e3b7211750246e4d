"""The shape every transfer handle shares: awaitable, ``progress``, ``done``,
``cancel``, ``wait(timeout)``; resolved once by its transport.  And the typed
statistics both transports report: one family rooted in :class:`TransferStats`
-- TCP's two directions, :class:`SendStats` and :class:`ReceiveStats`, and
UCX's :class:`UcxStats` (both directions of one one-sided transfer)."""

from __future__ import annotations

import abc
import asyncio
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .._waits import wait_within
from ..errors import InvalidArgument, TransferTimeout

__all__ = [
    "DEFAULT_TRANSFER_TIMEOUT",
    "ReceiveStats",
    "SendStats",
    "TransferHandleBase",
    "TransferStats",
    "UcxStats",
    "transfer_timeout",
]

R = TypeVar("R")

# every transfer has a deadline; this one when the caller names none
DEFAULT_TRANSFER_TIMEOUT = 60.0


def transfer_timeout(timeout: float | None) -> float:
    """The deadline of a transfer in seconds: ``timeout``, or the default for
    None; it must be finite and positive (no wait lasts for ever)."""
    t = DEFAULT_TRANSFER_TIMEOUT if timeout is None else float(timeout)
    if not (t > 0 and math.isfinite(t)):
        raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
    return t


@dataclass
class TransferStats:
    """What one transfer moved: ``bytes`` (raw, as the engine sees them),
    ``wire_bytes`` (chunk bodies on the wire, after compression; resends and
    duplicates included), ``seconds`` (from the call to completion), ``chunks``
    (chunk frames: sent, or received and written)."""

    bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    chunks: int = 0

    @property
    def goodput_Bps(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SendStats(TransferStats):
    """The sender's view: ``retries`` (chunks sent again: NACK, a lost
    connection, an acknowledgement that did not come in time), ``streams``
    (connections that carried this transfer's data), ``chunk_size``,
    ``compression`` (the decision and its numbers)."""

    retries: int = 0
    streams: int = 0
    chunk_size: int = 0
    compression: dict[str, Any] = field(default_factory=dict)

    @property
    def chunks_sent(self) -> int:
        return self.chunks


@dataclass
class ReceiveStats(TransferStats):
    """The receiver's view: ``duplicates`` (frames whose bytes it held or was
    writing already), ``bad_chunks`` (frames that failed their checksum or
    decoding, asked for again), ``placed`` (frames read straight into the
    destination's memory)."""

    duplicates: int = 0
    bad_chunks: int = 0
    placed: int = 0


@dataclass
class UcxStats(TransferStats):
    """What one UCX send or receive did: ``request_id``, ``direction``
    (``"send"`` or ``"recv"``), ``path`` (``"put"``: zero-copy, or
    ``"staging"``: pack, put, unpack), ``runs`` (one-sided puts posted, after
    coalescing), ``retries`` (always 0: UCX retransmits below kvbridge),
    ``layers_done`` (receiver: layers of the expected range that landed),
    ``started`` / ``finished`` (``time.monotonic()``).  ``bytes`` counts the KV
    bytes moved (put payload, or wire bytes when staged); ``wire_bytes`` equals
    it (UCX sends them uncompressed) and ``seconds`` is ``finished - started``,
    both set when the transfer resolves."""

    request_id: str = ""
    direction: str = ""
    path: str = ""
    runs: int = 0
    retries: int = 0
    layers_done: int = 0
    started: float = 0.0
    finished: float = 0.0

    def close(self, now: float) -> None:
        """The transfer resolved at ``now``: fix ``finished``, ``seconds``
        and ``wire_bytes``."""
        self.finished = now
        self.seconds = now - self.started
        self.wire_bytes = self.bytes

    @property
    def gbps(self) -> float:
        s = self.seconds
        return self.bytes / s / 1e9 if s > 0 else 0.0


class TransferHandleBase(abc.ABC, Generic[R]):
    """Subclasses set ``_what`` (for the timeout message), ``_cancel_reason``,
    and implement ``_moved_bytes`` and ``_result``."""

    _what = "complete"
    _cancel_reason = "cancelled"

    def __init__(
        self, request_id: str, total: int, on_cancel: Callable[[str], None] | None = None
    ) -> None:
        self.request_id = request_id
        self.total_bytes = total
        self._fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        if on_cancel is not None:  # else the subclass defines the _on_cancel method
            self._on_cancel = on_cancel
        self._t0 = time.perf_counter()

    @abc.abstractmethod
    def _moved_bytes(self) -> int:
        """Bytes moved so far (received, or acknowledged)."""

    @abc.abstractmethod
    def _result(self, seconds: float) -> R:
        """What awaiting the handle returns once the transfer succeeded."""

    @property
    def progress(self) -> float:
        return 1.0 if self.total_bytes == 0 else self._moved_bytes() / self.total_bytes

    def done(self) -> bool:
        return self._fut.done()

    def cancel(self, reason: str | None = None) -> None:
        """Stop the transfer at both ends (ABORT) and release its buffers."""
        if not self._fut.done():
            self._on_cancel(reason or self._cancel_reason)

    async def wait(self, timeout: float | None = None) -> R:
        return await wait_within(
            asyncio.shield(self._fut),
            timeout,
            lambda: TransferTimeout(
                f"transfer {self.request_id!r} not {self._what} after {timeout} s"
            ),
        )

    def __await__(self) -> Generator[Any, None, R]:
        return asyncio.shield(self._fut).__await__()

    def _resolve(self, exc: BaseException | None) -> None:
        if not self._fut.done():
            self._settle(exc, None if exc else self._result(time.perf_counter() - self._t0))

    def _settle(self, exc: BaseException | None, result: R | None) -> None:
        """Resolve the (pending) future with ``exc``, or else ``result``."""
        if exc is None:
            self._fut.set_result(result)  # type: ignore[arg-type]
        else:
            self._fut.set_exception(exc)
            self._fut.exception()  # mark retrieved: the owner may never await a failed handle
