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

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import Cancelled, InvalidArgument, KVBridgeError, TransferTimeout
from ..transport.tcp.kvio import KVSource
from .handles import Delivery, DeliveryStats, SendGroup
from .ticket import Ticket

if TYPE_CHECKING:
    from .prefill import PrefillBridge

__all__ = ["LayerwiseSend", "LayerwiseSource"]


class LayerwiseSource(KVSource):
    def __init__(
        self,
        cache: Any,
        block_table: Any,
        start: int,
        end: int,
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


class LayerwiseSend(SendGroup):
    """A send whose layers are released as prefill computes them."""

    def __init__(
        self,
        bridge: PrefillBridge,
        rid: str,
        block_table: Any,
        tickets: dict[str, Ticket],
        priority: int,
        timeout: float | None,
        layer_timeout: float,
    ) -> None:
        super().__init__(rid, list(tickets))
        self.bridge = bridge
        self.block_table = block_table
        self.tickets = tickets
        self.timeout = timeout
        self._sources: dict[str, LayerwiseSource] = {}
        self._ucx_parts: dict[str, list[Delivery]] = {
            n: [] for n in tickets if n not in bridge._tcp
        }
        self._ucx_sent: dict[str, int] = {n: tickets[n].layer_start for n in self._ucx_parts}
        self._ucx_released = {n: asyncio.Event() for n in self._ucx_parts}
        self._ended: KVBridgeError | None = None
        self._tcp: dict[str, Delivery] = {}
        for name, t in tickets.items():
            if name in bridge._tcp:
                src = LayerwiseSource(
                    bridge.cache,
                    block_table,
                    t.start,
                    t.end,
                    (t.layer_start, t.layer_end),
                    heads=bridge.send_heads(name, t),
                    layer_timeout=layer_timeout,
                )
                self._sources[name] = src
                d = bridge._tcp_delivery(name, rid, src, t, priority, timeout)
                # a transfer that ended early must not leave a pack waiting for its layers
                d.add_done_callback(_wake(src))
                self._tcp[name] = d
            elif t.layer_start == t.layer_end:
                self._ucx_released[name].set()
        self._tasks = self._start_watching()

    def layers_ready(self, layer_end: int) -> None:
        """Layers below ``layer_end`` are computed: let them leave."""
        if not 0 <= layer_end <= self.bridge.layout.num_layers:
            raise InvalidArgument(f"layer {layer_end} outside [0, {self.bridge.layout.num_layers}]")
        if self._ended is not None:
            return
        for src in self._sources.values():
            src.mark_ready(min(max(layer_end, src.layers[0]), src.layers[1]))
        for name, parts in self._ucx_parts.items():
            t = self.tickets[name]
            lo, hi = self._ucx_sent[name], min(layer_end, t.layer_end)
            if hi > lo:
                try:
                    d = self.bridge._ucx_delivery(
                        name, self.request_id, self.block_table, t, (lo, hi), self.timeout
                    )
                except KVBridgeError as exc:
                    # refused to post (the receiver aborted the request, the peer
                    # is gone): this destination ends with the error, no layer follows
                    d = _failed(DeliveryStats(self.request_id, name, "ucx"), exc)
                    hi = t.layer_end
                parts.append(d)
                self._ucx_sent[name] = hi
                if hi == t.layer_end:
                    self._ucx_released[name].set()

    def _end(self, exc: KVBridgeError) -> None:
        if self._ended is not None:
            return
        self._ended = exc
        for src in self._sources.values():
            src.cancel()
        for d in self._tcp.values():
            d.fail(exc)
        for name, parts in self._ucx_parts.items():
            pending = [d for d in parts if not d.done()]
            for d in pending:
                d.fail(exc)
            if not pending and self._ucx_sent[name] < self.tickets[name].layer_end:
                self._tell_ucx_receiver(name, str(exc))
            self._ucx_released[name].set()

    def _tell_ucx_receiver(self, name: str, reason: str) -> None:
        """No part of this destination is in flight, yet its receiver waits
        for layers that will not come: an ABORT tells it."""
        try:
            self.bridge._ucx_peers[name].abort(self.request_id, Cancelled(reason))
        except KVBridgeError:
            return  # the peer is gone or closed: its expect fails by itself

    def cancel(self, reason: str = "cancelled by the sender") -> None:
        self._end(Cancelled(reason))

    def fail(self, exc: KVBridgeError) -> None:
        self._end(exc)

    async def outcome(self, name: str) -> DeliveryStats:
        if name in self._tcp:
            return await self._tcp[name]
        await self._ucx_released[name].wait()
        t = self.tickets[name]
        total = DeliveryStats(self.request_id, name, "ucx")
        for d in list(self._ucx_parts[name]):
            st = await d
            total.bytes += st.bytes
            total.wire_bytes += st.wire_bytes
            total.seconds = max(total.seconds, st.seconds)
            total.path = st.path
        if self._ucx_sent[name] < t.layer_end:
            assert self._ended is not None
            raise self._ended
        return total

    async def wait(self, timeout: float | None = None) -> dict[str, DeliveryStats]:
        """Every layer delivered to every destination (call after the last
        ``layers_ready``)."""
        for name in self._ucx_parts:
            t = self.tickets[name]
            if self._ucx_sent[name] < t.layer_end and self._ended is None:
                raise InvalidArgument(f"{name}: layers from {self._ucx_sent[name]} never released")
        return await super().wait(timeout)


def _failed(stats: DeliveryStats, exc: KVBridgeError) -> Delivery:
    async def fail() -> None:
        raise exc

    return Delivery(stats, fail(), lambda: 0.0, lambda _reason: None)


def _wake(src: LayerwiseSource) -> Callable[[Delivery], None]:
    def done(_d: Delivery) -> None:
        src.cancel()

    return done
