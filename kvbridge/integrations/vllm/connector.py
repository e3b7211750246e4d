"""``KVBridgeConnector``: kvbridge as a vLLM v1 KV connector.

vLLM loads it with::

    KVTransferConfig(kv_connector="KVBridgeConnector",
                     kv_connector_module_path="kvbridge.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={...})   # kvbridge.integrations.vllm.config

vLLM makes one instance in the engine core (``KVConnectorRole.SCHEDULER``:
:class:`~.scheduler.ConnectorScheduler`) and one per worker
(``KVConnectorRole.WORKER``: :class:`~.worker.ConnectorWorker`); this
class only forwards vLLM's calls to them.  docs/vllm.md describes the
design and the operator's commands.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...bridge.sync import SyncBridge
from ...errors import InvalidArgument
from ...layout import tp_head_range
from .cache import ask_huge_pages, describe_vllm_cache
from .config import ConnectorConfig
from .plan import StepPlan, WorkerReport
from .scheduler import ConnectorScheduler
from .stats import KVBridgePromMetrics, KVBridgeStats
from .worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector", "KVBridgeMetadata", "KVBridgeWorkerMetadata"]

logger = init_logger(__name__)


def _share_vllm_logging() -> None:
    """kvbridge's loggers write where vLLM's do (the engine's log), at
    ``$KVBRIDGE_LOG_LEVEL`` (default INFO)."""
    import logging
    import os

    kvb = logging.getLogger("kvbridge")
    if not kvb.handlers:
        h = logging.StreamHandler()
        h.setFormatter(
            logging.Formatter(
                "(kvbridge pid=%(process)d) %(levelname)s %(asctime)s.%(msecs)03d %(name)s: %(message)s",
                "%m-%d %H:%M:%S",
            )
        )
        kvb.addHandler(h)
        kvb.setLevel(os.environ.get("KVBRIDGE_LOG_LEVEL", "INFO").upper())
        kvb.propagate = False


class KVBridgeMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, once per step (aggregated over workers)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVBridgeWorkerMetadata)
        return KVBridgeWorkerMetadata(self.report.merge(other.report))


class KVBridgeConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Prefill (``kv_producer``), decode (``kv_consumer``) or both."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _share_vllm_logging()
        tc = self._kv_transfer_config
        self._producer = bool(tc.is_kv_producer)
        self._consumer = bool(tc.is_kv_consumer)
        par = vllm_config.parallel_config
        if int(getattr(par, "pipeline_parallel_size", 1)) != 1:
            raise InvalidArgument(
                "KVBridgeConnector moves KV between tensor-parallel ranks; "
                "pipeline parallelism is not supported (pipeline_parallel_size must be 1)"
            )
        tp_size = int(getattr(par, "tensor_parallel_size", 1))
        cfg = ConnectorConfig.from_extra(
            tc.kv_connector_extra_config,
            engine_id=str(tc.engine_id),
            model=str(vllm_config.model_config.model),
        )
        tp_rank = 0
        if role != KVConnectorRole.SCHEDULER and tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
        self.cfg = dataclasses.replace(cfg, tp_rank=tp_rank, tp_size=tp_size)
        self._kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        self._block_size = int(vllm_config.cache_config.block_size)
        self._sched: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = ConnectorScheduler(
                self.cfg.identity,
                producer=self._producer,
                consumer=self._consumer,
                tp_size=tp_size,
            )
        else:
            self._worker = ConnectorWorker(
                self.cfg, producer=self._producer, consumer=self._consumer, make_bridge=SyncBridge
            )
        logger.info(
            "kvbridge connector %s (%s, %s, tensor-parallel rank %d of %d)",
            self.cfg.rank_identity,
            tc.kv_role,
            role.name.lower(),
            tp_rank,
            tp_size,
        )

    # ---- class methods -------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # kvbridge describes whatever layout the backend chose

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: vLLM (0.33 and later) refuses sleep mode with this connector.
        Sleep mode remaps the KV cache memory, and kvbridge's registrations
        (the pack core's cache handles, UCX memory regions, leases on pages)
        would point at memory that is gone; docs/vllm.md says why this is the
        choice and not ``unregister_kv_caches`` / ``restore_kv_caches``."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """A prefill hands KV off: vLLM recomputes a request preempted while
        its hand-off is pending rather than finishing it (vLLM's default)."""
        return self._producer

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool((extra_config or {}).get("layerwise", True))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=data) if data is not None else KVBridgeStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._sched is not None
        self._sched.bind_block_ids(lambda rid: list(kv_cache_manager.get_block_ids(rid)[0]))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return KVBridgeMetadata(self._sched.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, KVBridgeWorkerMetadata) else None
        self._sched.update_connector_output(
            finished_sending=connector_output.finished_sending or (),
            finished_recving=connector_output.finished_recving or (),
            report=report,
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    # ---- worker side ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        tensors = [kv_caches[n] for n in names]
        first, _n = tp_head_range(self._kv_heads, self.cfg.tp_size, self.cfg.tp_rank)
        cache, ratio = describe_vllm_cache(
            tensors,
            self._block_size,
            self._kv_cache_config,
            head_start=first,
            model_kv_heads=self._kv_heads,
        )
        pages = ask_huge_pages(cache) if self.cfg.huge_pages and not cache.is_cuda else ""
        if cache.is_cuda:
            from .order import CudaEvents

            self._worker.use_events(CudaEvents(tensors[0].device))
        self._worker.register(cache, names, ratio)
        logger.info(
            "kvbridge %s: %s, %d layers, %d kernel blocks per vLLM block%s%s",
            self.cfg.rank_identity,
            cache.layout.describe(),
            len(names),
            ratio,
            pages,
            f", listening on {self.cfg.rank_listen[0]}:{self._worker.tcp_port}"
            if self.cfg.rank_listen and self._consumer
            else "",
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVBridgeMetadata):
            self._worker.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.begin_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a decode's KV is complete before vLLM schedules the request

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        assert self._worker is not None
        self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        fs, fr, ff = self._worker.results()
        return KVConnectorTransferResults(
            finished_sending=fs, finished_recving=fr, failed_recving=ff
        )

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        rep = self._worker.report()
        return KVBridgeWorkerMetadata(rep) if rep is not None else None

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        if self._worker is None:
            return None
        c = self._worker.take_counters()
        return KVBridgeStats.of(c) if c is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
