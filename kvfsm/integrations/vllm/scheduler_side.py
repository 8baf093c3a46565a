"""The connector's scheduler role: vLLM's scheduler calls in, kvfsm's `SchedulerConnector` decides.

Two places where vLLM's protocol differs from kvfsm's, bridged here and nowhere else:
- vLLM calls `update_state_after_alloc` a second time when a request whose load finished is admitted, and looks a
  request up again when a failed load left it nothing valid; kvfsm allocated and ran that request already, so the
  second call is ignored and the repeated lookup answers "nothing to load".
- vLLM learns which requests finished loading (`finished_recving`) or may free their blocks (`finished_sending`)
  from the workers' output; kvfsm decides both once every worker reported the job, so the scheduler role writes its
  answer into that output before vLLM reads it (`update_connector_output` runs first). With `layer_loads` a CPU hit
  is a synchronous load: vLLM computes the request in the step that loads it and waits for nothing, so a finished
  load is news to vLLM only as a failed load's blocks, which the workers name themselves in that step's output
  (`load_reports_in_step`). Under vLLM's async scheduling the next step is scheduled before that output is read, so
  a failed load's token could not be taken back: CPU hits then load asynchronously whatever `layer_loads` says
  (`no-inline-load-under-async-scheduling`), and start-up logs it once.
The lower tiers' bytes live in the workers; this process plans every write-back and fetch against an index of each
tier fed by the workers' reports (`tier_index`), whose orders and discards go out in the step's metadata.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVCacheEvent
from vllm.v1.request import RequestStatus

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorOutput
from kvfsm.connector import scheduler
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.integrations.vllm.config import gpu_block_bytes
from kvfsm.integrations.vllm.convert import (
    BlockTables,
    HashCodec,
    KvfsmMetadata,
    KvfsmWorkerMetadata,
    RequestView,
    group_block_ids,
    scheduler_output,
)
from kvfsm.integrations.vllm.telemetry import StatsDelta
from kvfsm.integrations.vllm.tier_events import to_vllm
from kvfsm.integrations.vllm.tier_index import TierIndexes
from kvfsm.machines import MachineSet
from kvfsm.states import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_NORMAL_FINISH = frozenset({
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_REPETITION,
})
"""Finishes of a running request; any other finish (abort, error, ignored) may come from any state: an abort."""


class UnexpectedAllocation(RuntimeError):
    """vLLM allocated external tokens for a request the connector offered none."""


class SchedulerSide:
    def __init__(self, config: OffloadConfig, kv_cache_config: "KVCacheConfig") -> None:
        block_bytes = gpu_block_bytes(kv_cache_config)
        machines = MachineSet(scheduler.default_spec())  # the spec the connector would load (tests swap it there)
        self.tier_index = TierIndexes(config, config.block_size_factor * block_bytes, machines)
        """The lower tiers' indexes: the workers hold the bytes, this process decides every write-back and fetch."""
        self.kvfsm = SchedulerConnector(config, block_bytes, machines=machines,
                                        num_gpu_blocks=kv_cache_config.num_blocks, tiers=self.tier_index.tiers)
        self.kvfsm.load_reports_in_step = True  # vLLM reads invalid blocks only in the output of their step
        if config.layer_loads and not config.inline_loads:
            log.warning("kvfsm: layer_loads is set but vLLM schedules each step before it read the previous one's "
                        "output (async scheduling, or pipeline parallelism), so a failed load's step could not be "
                        "taken back; CPU hits load asynchronously instead (kvfsm_loads_total{mode=\"async\"}). Per-layer "
                        "loads need --no-async-scheduling and no pipeline parallelism.")
        self.codec = HashCodec()
        self.stats = StatsDelta(self.kvfsm.stats, self.kvfsm.manager.usage,
                                self.kvfsm.tiers.totals if self.kvfsm.tiers is not None else dict)
        self._matched: dict[str, RequestView] = {}
        self.block_tables = BlockTables()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        record = self.kvfsm.requests.get(request.request_id)
        if record is not None and record.state == RequestState.RUNNING:
            return 0, False
        view = RequestView(request, self.codec)
        match = self.kvfsm.get_num_new_matched_tokens(view, num_computed_tokens)
        if match is None:
            self._matched.pop(request.request_id, None)
            return None, False
        self._matched[request.request_id] = view
        return match

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        view = self._matched.pop(request.request_id, None)
        if view is None:
            if num_external_tokens:
                raise UnexpectedAllocation(
                    f"vLLM allocated {num_external_tokens} external tokens for {request.request_id!r} "
                    "without a lookup that offered them")
            return
        self.kvfsm.update_state_after_alloc(view, group_block_ids(blocks), num_external_tokens)

    def build_connector_meta(self, output: "SchedulerOutput") -> KvfsmMetadata:
        orders = self.kvfsm.build_connector_meta(scheduler_output(output, self.block_tables))
        self.tier_index.ordered(orders.tier_orders, self.kvfsm.tier_jobs)
        return KvfsmMetadata(orders, tier_discards=self.tier_index.take_discards())

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if meta is not None and not isinstance(meta, KvfsmWorkerMetadata):
            raise TypeError(f"expected kvfsm worker metadata, got {type(meta).__name__}")
        result = self.kvfsm.update_connector_output(ConnectorOutput(workers=meta.reports if meta else ()))
        self.tier_index.settle(meta.evicted if meta else (), meta.namespaces if meta else ())
        self.kvfsm.get_block_ids_with_load_errors()  # the workers reported these blocks to vLLM themselves
        if result.loaded and not self.kvfsm.inline_loads:  # an inline load's request is running already
            output.finished_recving = set(output.finished_recving or ()) | result.loaded
        if result.released:
            output.finished_sending = set(output.finished_sending or ()) | result.released

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        aborted = request.status not in _NORMAL_FINISH
        return self.kvfsm.request_finished(request.request_id, aborted=aborted), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The CPU pool's events (`MEDIUM_CPU`), then each lower tier's (`MEDIUM_STORAGE`, `tier_events`)."""
        for event in self.kvfsm.manager.take_events():
            yield to_vllm(event, self.codec.to_bytes, MEDIUM_CPU)
        for tier in self.tier_index.tiers:
            for event in tier.take_events():
                yield to_vllm(event, self.codec.to_bytes, MEDIUM_STORAGE, tier.locality, tier.name)

    def reset_cache(self) -> bool:
        self.kvfsm.reset_cache()
        return True

    def close(self) -> None:
        """Close the shared tiers' master clients."""
        self.tier_index.close()

    @property
    def moving_between_tiers(self) -> bool:
        """A write-back or fetch is in flight, or discards wait for the next metadata: vLLM must keep stepping
        (`has_pending_push_work`) until every rank reported the job or got the discards, even with no request left."""
        return self.kvfsm.moving_between_tiers or self.tier_index.discards_pending
