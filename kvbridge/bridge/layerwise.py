"""Layer-by-layer sending on the TCP path.

The wire layout puts layers outermost, so the bytes of layers ``[l0, l)`` are
a prefix of the transfer.  :class:`LayerwiseSource` lets the transport read
that prefix while prefill is still computing the later layers: a read waits
(with a deadline) until every layer it touches has been marked ready.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import Cancelled, InvalidArgument, TransferTimeout
from ..transport.tcp.kvio import KVSource

__all__ = ["LayerwiseSource"]


class LayerwiseSource(KVSource):
    def __init__(
        self,
        cache: Any,
        block_table: Any,
        start: int,
        end: int,
        layers: tuple[int, int] | None = None,
        *,
        layer_timeout: float = 30.0,
    ) -> None:
        super().__init__(cache, block_table, start, end, layers)
        self._cond = threading.Condition()
        self._ready = self.layers[0]
        self._cancelled = False
        self.layer_timeout = layer_timeout
        n_layers = self.layers[1] - self.layers[0]
        self._per_layer = self.nbytes // n_layers if n_layers else 0

    @property
    def ready_until(self) -> int:
        return int(self._ready)

    def mark_ready(self, layer_end: int) -> None:
        """Layers below ``layer_end`` now hold their final KV."""
        l0, l1 = self.layers
        if not l0 <= layer_end <= l1:
            raise InvalidArgument(f"layer {layer_end} outside [{l0}, {l1}]")
        with self._cond:
            self._ready = max(self._ready, layer_end)
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def _pack_to(self, out: Any, offset: int, n: int) -> None:
        """Both ``read`` and ``read_into`` pack through here: wait until every
        layer that the slice touches is ready."""
        if self._per_layer and n:
            need = self.layers[0] + (offset + n - 1) // self._per_layer + 1
            deadline = time.monotonic() + self.layer_timeout
            with self._cond:
                while self._ready < need and not self._cancelled:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransferTimeout(
                            f"layer {need - 1} not ready after {self.layer_timeout} s"
                        )
                    self._cond.wait(left)
                if self._cancelled:
                    raise Cancelled("layer-wise send cancelled")
        super()._pack_to(out, offset, n)
