"""The TCP transport's handles: :class:`SendHandle` (an outgoing transfer) and
:class:`ExpectHandle` (an expected incoming one), over the shared
:class:`~kvbridge.transport.handle.TransferHandleBase` and typed stats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..handle import ReceiveStats, SendStats, TransferHandleBase
from .kvio import Sink

__all__ = ["ExpectHandle", "SendHandle"]


class SendHandle(TransferHandleBase[SendStats]):
    """One outgoing transfer.  Awaitable (returns :class:`SendStats` once the
    receiver confirmed every byte); ``progress`` is the acknowledged fraction."""

    _what = "confirmed"
    _cancel_reason = "cancelled by the sender"

    def __init__(self, request_id: str, total: int, on_cancel: Callable[[str], None]) -> None:
        super().__init__(request_id, total, on_cancel)
        self.stats = SendStats(bytes=total)
        self._transfer: Any = None  # the TxTransfer (set by the sender)

    @property
    def acked_bytes(self) -> int:
        """Bytes the receiver confirmed so far."""
        return int(self._transfer.acked_bytes) if self._transfer is not None else 0

    def _moved_bytes(self) -> int:
        return self.acked_bytes

    def _result(self, seconds: float) -> SendStats:
        self.stats.seconds = seconds
        return self.stats


class ExpectHandle(TransferHandleBase[int]):
    """One expected incoming transfer.  Awaitable (returns the byte count);
    ``token`` goes to the sender; ``progress`` is 0.0-1.0; ``stats`` is a
    :class:`ReceiveStats` (a snapshot at each read)."""

    _what = "complete"
    _cancel_reason = "cancelled by the receiver"

    def __init__(
        self, request_id: str, sink: Sink, token: bytes, on_cancel: Callable[[str], None]
    ) -> None:
        super().__init__(request_id, sink.nbytes, on_cancel)
        self.sink = sink
        self.token = token
        self._transfer: Any = None  # the RxTransfer (set by the receiver)
        self._seconds = 0.0

    @property
    def received_bytes(self) -> int:
        """Bytes verified and written into the sink so far."""
        return int(self._transfer.received_bytes) if self._transfer is not None else 0

    @property
    def stats(self) -> ReceiveStats:
        t = self._transfer
        return ReceiveStats(
            bytes=self.total_bytes,
            wire_bytes=t.wire_bytes,
            seconds=self._seconds,
            chunks=t.chunks,
            duplicates=t.duplicates,
            bad_chunks=t.bad_chunks,
            placed=t.placed,
        )

    def _moved_bytes(self) -> int:
        return self.received_bytes

    def _result(self, seconds: float) -> int:
        self._seconds = seconds
        return self.total_bytes
