"""`KvfsmConnector`: vLLM's KV-connector interface (v1, vLLM 0.32) in front of kvfsm's two connector halves.

vLLM builds one instance per role: in the scheduler process it delegates to `SchedulerSide`, in each worker to
`WorkerSide`. Calls that belong to the other role are refused with `WrongRole` rather than ignored, so a wiring
mistake shows at once. Loads are asynchronous under vLLM (a request is computed once its load is reported) unless
`layer_loads` is set and vLLM reads each step's output before it schedules the next (no async scheduling, no pipeline
parallelism): then a CPU hit is computed in the step that loads it, `start_load_kv` sends the step's loads one
segment per layer and `wait_for_layer_load` makes the compute stream wait for that layer's segment only.
`save_kv_layer` starts each layer's stores right after that layer's KV write when `layer_stores` is set (otherwise
stores follow the forward pass).
It declares vLLM's `SupportsHMA`: vLLM keeps its hybrid KV-cache allocator on and hands every group's blocks over
(`kvfsm.integrations.vllm.groups` says which kinds are offloaded and refuses the others by name at start-up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvfsm.integrations.vllm.config import offload_config
from kvfsm.integrations.vllm.convert import KvfsmWorkerMetadata
from kvfsm.integrations.vllm.prometheus import KvfsmPromMetrics
from kvfsm.integrations.vllm.scheduler_side import SchedulerSide
from kvfsm.integrations.vllm.telemetry import KvfsmStats
from kvfsm.integrations.vllm.worker_side import WorkerSide, default_device, worker_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class WrongRole(RuntimeError):
    """A scheduler-role method was called on a worker-role connector, or the other way round."""


class KvfsmConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = offload_config(vllm_config)
        self._scheduler = SchedulerSide(config, kv_cache_config) if role == KVConnectorRole.SCHEDULER else None
        self._worker = (WorkerSide(config, kv_cache_config, default_device(), worker_rank(config.num_workers))
                        if role == KVConnectorRole.WORKER else None)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a store lost to preemption is a later miss, never wrong output."""
        return False

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise WrongRole("this connector runs in a worker; the scheduler half is not here")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise WrongRole("this connector runs in the scheduler; the worker half is not here")
        return self._worker

    # --- worker role -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self.worker_side.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        self.worker_side.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Polls kvfsm's jobs; requests are reported by the scheduler role, which aggregates the workers."""
        self.worker_side.poll()
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> KvfsmWorkerMetadata | None:
        return self.worker_side.take_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # --- scheduler role --------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """The groups kvfsm's load restores for the request (`SchedulerSide.get_loaded_kv_cache_group_ids`), not
        vLLM's default (its prefix-cacheable groups), which leaves out bounded-replay windows kvfsm loads."""
        return self.scheduler_side.get_loaded_kv_cache_group_ids(request)

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid-allocator form of `request_finished` (every group's blocks): kvfsm reads its own tables."""
        return self.scheduler_side.request_finished(request)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self.scheduler_side.take_events()

    def reset_cache(self) -> bool:
        return self.scheduler_side.reset_cache()

    def has_pending_push_work(self) -> bool:
        """vLLM keeps stepping while this holds, with no request left: a write-back or fetch still in flight ends
        only with a step's worker reports."""
        return self._scheduler is not None and self._scheduler.moving_between_tiers

    def get_kv_connector_stats(self) -> KvfsmStats | None:
        return self._scheduler.stats.take() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvfsmStats:
        return KvfsmStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics:
        return KvfsmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
