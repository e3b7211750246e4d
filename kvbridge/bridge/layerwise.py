"""Layer-by-layer sending.

The wire layout puts layers outermost, so the bytes of layers ``[l0, l)`` are
a prefix of the transfer.  On TCP, :class:`LayerwiseSource` lets the
transport send that prefix while prefill is still computing the later
layers.  It tells the transport how many bytes are ready (``ready_bytes``)
and calls back when more are (``on_ready``): the TCP sender sends only chunks
whose layers are ready, so a chunk that waits for its layers waits on the
event loop, holds no thread, and lets other transfers' chunks go first.
``ready_timeout`` (the ``layer_timeout``) bounds how long the transfer may
wait for the next layer.  A reader that does not look at ``ready_bytes``
still gets correct bytes: its read waits, with the same deadline, until
every layer it touches is ready.  On UCX each released layer range is one
more part (one more put batch).  :class:`LayerwiseSend` is the send of
both, per destination.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import Cancelled, InvalidArgument, KVBridgeError, TransferTimeout
from ..transport.tcp.kvio import KVSource
from .handles import DeliveryStats, SendGroup

__all__ = ["LayerFeed", "LayerwiseSend", "LayerwiseSource"]


class LayerwiseSource(KVSource):
    """A :class:`KVSource` of a span (or of the five values) whose layers
    become ready over time (:meth:`mark_ready`)."""

    def __init__(
        self,
        cache: Any,
        block_table: Any,
        start: int | None = None,
        end: int | None = None,
        layers: tuple[int, int] | None = None,
        *,
        heads: tuple[int, int] | None = None,
        layer_timeout: float = 30.0,
    ) -> None:
        super().__init__(cache, block_table, start, end, layers, heads)
        self._cond = threading.Condition()
        self._ready = self.layers[0]
        self._cancelled = False
        self.layer_timeout = layer_timeout
        n_layers = self.layers[1] - self.layers[0]
        self._per_layer = self.nbytes // n_layers if n_layers else 0
        self._callbacks: list[Callable[[], None]] = []

    @property
    def ready_until(self) -> int:
        return int(self._ready)

    @property
    def ready_bytes(self) -> int:
        """The bytes ``[0, ready_bytes)`` belong to ready layers."""
        if not self._per_layer:
            return int(self.nbytes)
        return int(self._ready - self.layers[0]) * self._per_layer

    @property
    def ready_timeout(self) -> float:
        return self.layer_timeout

    def on_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from the thread that marks layers ready) each
        time ``ready_bytes`` grows."""
        with self._cond:
            self._callbacks.append(callback)

    def mark_ready(self, layer_end: int) -> None:
        """Layers below ``layer_end`` now hold their final KV."""
        l0, l1 = self.layers
        if not l0 <= layer_end <= l1:
            raise InvalidArgument(f"layer {layer_end} outside [{l0}, {l1}]")
        with self._cond:
            grew = layer_end > self._ready
            self._ready = max(self._ready, layer_end)
            self._cond.notify_all()
            callbacks = list(self._callbacks) if grew else []
        for cb in callbacks:
            cb()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def _wait_ready(self, offset: int, n: int) -> None:
        """Every pack of a slice (``read``, ``read_into``, ``read_checksummed``)
        waits here until every layer that the slice touches is ready."""
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


class LayerFeed(Protocol):
    """One destination's share of a layer-wise send (implemented by each
    transport's destination, :mod:`kvbridge.bridge.destination`)."""

    def release(self, layer_end: int) -> None: ...

    def end(self, exc: KVBridgeError) -> None: ...

    def unreleased(self) -> int | None: ...

    async def outcome(self, ended: Callable[[], KVBridgeError | None]) -> DeliveryStats: ...


class LayerwiseSend(SendGroup):
    """A send whose layers are released as prefill computes them: one
    :class:`LayerFeed` per destination, fed by :meth:`layers_ready`."""

    def __init__(self, rid: str, num_layers: int, feeds: dict[str, LayerFeed]) -> None:
        super().__init__(rid, list(feeds))
        self.num_layers = num_layers
        self.feeds = feeds
        self._ended: KVBridgeError | None = None
        self._tasks = self._start_watching()

    def layers_ready(self, layer_end: int) -> None:
        """Layers below ``layer_end`` are computed: let them leave."""
        if not 0 <= layer_end <= self.num_layers:
            raise InvalidArgument(f"layer {layer_end} outside [0, {self.num_layers}]")
        if self._ended is not None:
            return
        for feed in self.feeds.values():
            feed.release(layer_end)

    def _end(self, exc: KVBridgeError) -> None:
        if self._ended is not None:
            return
        self._ended = exc
        for feed in self.feeds.values():
            feed.end(exc)

    def cancel(self, reason: str = "cancelled by the sender") -> None:
        self._end(Cancelled(reason))

    def fail(self, exc: KVBridgeError) -> None:
        self._end(exc)

    async def outcome(self, name: str) -> DeliveryStats:
        return await self.feeds[name].outcome(lambda: self._ended)

    async def wait(self, timeout: float | None = None) -> dict[str, DeliveryStats]:
        """Every layer delivered to every destination (call after the last
        ``layers_ready``)."""
        for name, feed in self.feeds.items():
            lo = feed.unreleased()
            if lo is not None and self._ended is None:
                raise InvalidArgument(f"{name}: layers from {lo} never released")
        return await super().wait(timeout)
