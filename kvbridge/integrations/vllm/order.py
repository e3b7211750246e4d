"""When a layer-wise send may read a layer: ordering against the engine's stream.

``save_kv_layer`` is called on the engine's thread when vLLM has *launched*
the layer's attention (on a GPU the kernels may still be running); on a CPU
cache the layer is written when the call comes.  :class:`LayerGate` releases
layer ``i`` of this step's layer-wise sends to the bridge only once it is
written:

* CPU (``events=None``): at once, as before.
* CUDA (:class:`CudaEvents`): ``save_kv_layer`` records an event on vLLM's
  current stream; a helper thread waits for that one event
  (``Event.synchronize``: the host waits for the work queued before it on
  that stream, never for the whole device) and then releases the layer, so
  the bridge's pack of the layer (on the bridge's own stream) starts after
  the layer's writes.  Events of one stream complete in order, so the thread
  takes them first in, first out, and ``layers_ready`` only ever grows.

The receive side needs nothing here: the bridge reports a delivery only after
its sink has synchronized the stream its writes went to (``KVSink.finish``),
so blocks reported in ``finished_recving`` are complete for any stream of
vLLM that reads them afterwards.

The gate knows no vLLM and no bridge: ``release(request_ids, n)`` is the
bridge's ``layers_ready`` for each request; the event source is injected
(tests pass a fake stream and event).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["CudaEvents", "EventSource", "LayerGate"]

log = logging.getLogger("kvbridge.vllm")


class EventSource(Protocol):
    def record(self) -> Any:
        """An event recorded now on the engine's current stream; it has
        ``synchronize()`` (wait for it, on the host) and ``query()``."""


class CudaEvents:
    """Events on vLLM's current CUDA stream of ``device``."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)

    def record(self) -> Any:
        ev = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(self._torch.cuda.current_stream(self.device))
        return ev


class LayerGate:
    """Releases layers of layer-wise sends once the engine has written them."""

    def __init__(
        self,
        release: Callable[[Sequence[str], int], None],
        events: EventSource | None = None,
        *,
        name: str = "kvbridge-layers",
    ) -> None:
        self._release = release
        self._events = events
        self._q: queue.SimpleQueue[tuple[tuple[str, ...], int, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._queued = 0
        self._done = 0
        if events is not None:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    @property
    def ordered(self) -> bool:
        """True when layers wait for an event (a CUDA cache)."""
        return self._events is not None

    def layer_written(self, request_ids: Sequence[str], n: int) -> None:
        """Layers ``[0, n)`` of ``request_ids`` have been issued by the engine."""
        if not request_ids:
            return
        ids = tuple(request_ids)
        if self._events is None:
            self._release(ids, n)
            return
        ev = self._events.record()
        with self._idle:
            self._queued += 1
        self._q.put((ids, n, ev))

    def pending(self) -> int:
        """Layer releases still waiting for their event."""
        with self._idle:
            return self._queued - self._done

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every queued layer is released."""
        with self._idle:
            return self._idle.wait_for(lambda: self._done >= self._queued, timeout)

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            ids, n, ev = item
            try:
                ev.synchronize()  # this event only: the work queued before it on its stream
                self._release(ids, n)
            except Exception as e:  # a failed release must not stop later layers
                log.warning("layers [0, %d) of %s: %s", n, ids, e)
            with self._idle:
                self._done += 1
                self._idle.notify_all()
