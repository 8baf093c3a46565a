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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.request import RequestStatus

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import ConnectorOutput
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
from kvfsm.manager.events import BlockStored as KvfsmBlockStored
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
        self.kvfsm = SchedulerConnector(config, gpu_block_bytes(kv_cache_config),
                                        num_gpu_blocks=kv_cache_config.num_blocks)
        self.kvfsm.load_reports_in_step = True  # vLLM reads invalid blocks only in the output of their step
        if config.layer_loads and not config.inline_loads:
            log.warning("kvfsm: layer_loads is set but vLLM schedules each step before it read the previous one's "
                        "output (async scheduling, or pipeline parallelism), so a failed load's step could not be "
                        "taken back; CPU hits load asynchronously instead (kvfsm_loads_total{mode=\"async\"}). Per-layer "
                        "loads need --no-async-scheduling and no pipeline parallelism.")
        self.codec = HashCodec()
        self.stats = StatsDelta(self.kvfsm.stats, self.kvfsm.manager.usage)
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
        return KvfsmMetadata(self.kvfsm.build_connector_meta(scheduler_output(output, self.block_tables)))

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if meta is not None and not isinstance(meta, KvfsmWorkerMetadata):
            raise TypeError(f"expected kvfsm worker metadata, got {type(meta).__name__}")
        result = self.kvfsm.update_connector_output(ConnectorOutput(workers=meta.reports if meta else ()))
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
        for event in self.kvfsm.manager.take_events():
            hashes = [self.codec.to_bytes(h) for h in event.hashes]
            if isinstance(event, KvfsmBlockStored):
                yield BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0,
                                  lora_id=None, medium=MEDIUM_CPU, lora_name=None)
            else:
                yield BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU)

    def reset_cache(self) -> bool:
        self.kvfsm.reset_cache()
        return True
