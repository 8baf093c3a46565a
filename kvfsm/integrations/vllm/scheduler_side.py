"""The connector's scheduler role: vLLM's scheduler calls in, kvfsm's `SchedulerConnector` decides.

Three places where vLLM's protocol differs from kvfsm's, bridged here and nowhere else:
- vLLM calls `update_state_after_alloc` a second time when a request whose load finished is admitted, and looks a
  request up again when a failed load left it nothing valid; kvfsm allocated and ran that request already, so the
  second call is ignored and the repeated lookup answers "nothing to load".
- vLLM asks about a request that reads no prefix cache (`skip_reading_prefix_cache`: prompt logprobs, pooling) and
  then sets the answer aside, a deferral included, scheduling it at once with no external tokens; kvfsm looks it up as
  one whose whole prompt is computed, so it is tracked as vLLM runs it (matched, then allocated) and never deferred.
- vLLM learns which requests finished loading (`finished_recving`) or may free their blocks (`finished_sending`)
  from the workers' output; kvfsm decides both once every worker reported the job, so the scheduler role writes its
  answer into that output before vLLM reads it (`update_connector_output` runs first). With `layer_loads` a CPU hit
  is a synchronous load: vLLM computes the request in the step that loads it and waits for nothing, so a finished
  load is news to vLLM only as a failed load's blocks, which the workers name themselves in that step's output
  (`load_reports_in_step`). Under vLLM's async scheduling the next step is scheduled before that output is read, so
  a failed load's token could not be taken back: CPU hits then load asynchronously whatever `layer_loads` says
  (`no-inline-load-under-async-scheduling`), and start-up logs it once.
Under vLLM's hybrid allocator each KV-cache group of a request is a request of its own in kvfsm's scheduler
(`groups`): a lookup offers the longest prefix every group holds (a later full-attention group all of it, a
sliding-window group its whole window ending there, a state-space group the state at its end: `window_hit`), vLLM
hears of a load or a release once every group's is done, vLLM is told exactly the groups a load restores
(`loaded-groups`: a bounded-replay window only when the load writes it whole), and a sliding window's (or a state's)
left-behind blocks are told to kvfsm (`slide`) before the step that may hand them out is planned.
The lower tiers' bytes live in the workers; this process plans every write-back and fetch against an index of each
tier fed by the workers' reports (`tier_index`), whose orders and discards go out in the step's metadata.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVCacheEvent
from vllm.v1.request import RequestStatus

from kvfsm.config import OffloadConfig
from kvfsm.connector.ledger import NOTHING_ENDED
from kvfsm.connector.metadata import ConnectorOutput, SchedulerOutput as KvfsmSchedulerOutput
from kvfsm.connector import scheduler
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.connector.tracked_ids import TrackedIds
from kvfsm.integrations.vllm.config import gpu_block_bytes
from kvfsm.integrations.vllm.convert import (
    BlockTables,
    HashCodec,
    KvfsmMetadata,
    KvfsmWorkerMetadata,
    RequestView,
    computed_before,
    group_block_ids,
    scheduler_output,
)
from kvfsm.integrations.vllm.groups import Group, GroupView, is_first_group_key, offloaded_groups
from kvfsm.integrations.vllm.telemetry import StatsDelta
from kvfsm.integrations.vllm.tier_events import to_vllm
from kvfsm.integrations.vllm.tier_index import TierIndexes
from kvfsm.integrations.vllm.window_hit import WindowHits
from kvfsm.machines import MachineSet
from kvfsm.states import RequestState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

NULL_BLOCK = 0
"""vLLM's null block: the id its tables name where a sliding window holds no block (never stored nor loaded)."""

_NORMAL_FINISH = frozenset({
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_REPETITION,
})
"""Finishes of a running request; any other finish (abort, error, ignored) may come from any state: an abort."""


NOTHING_SCHEDULED = KvfsmSchedulerOutput()
"""What kvfsm is told of a step vLLM scheduled, finished and preempted nothing in."""
NO_REPORTS = ConnectorOutput()
"""What kvfsm is told of a step's output no worker reported anything in."""


class UnexpectedAllocation(RuntimeError):
    """vLLM allocated external tokens for a request the connector offered none."""


class SchedulerSide:
    def __init__(self, config: OffloadConfig, kv_cache_config: "KVCacheConfig") -> None:
        block_bytes = gpu_block_bytes(kv_cache_config)
        self.groups = offloaded_groups(kv_cache_config, config.gpu_block_size, config.block_size_factor)
        self.windows = self.groups[1:]
        """Every group after the first, each matched, stored and slid as a window: vLLM keeps only the end of a sliding
        window, a state or a chunk, and all of a later full-attention group (a window that keeps every block)."""
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
        self._matched: dict[str, tuple[RequestView | GroupView, ...]] = {}
        self._views: dict[str, tuple[RequestView, tuple[GroupView, ...]]] = {}
        """Each unfinished looked-up request's views (`_views_of`)."""
        self._waiting: dict[str, set[str]] = {}
        """Per request, the groups whose load (or, once it ended, whose draining) vLLM still waits for."""
        self.tracked = TrackedIds()
        """Each tracked id's request, from its first lookup until nothing of it is left to report: a request's own id
        may hold `@g`, so a tracked id is never parsed back (`_whole`)."""
        self.block_tables = BlockTables(self.groups)
        self.window_hits = WindowHits(self.kvfsm, self.windows)
        """The hit offered a request with sliding-window groups (`longest-window-hit`)."""

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self.stats.moved = True
        record = self.kvfsm.requests.get(request.request_id)
        if record is not None and record.state == RequestState.RUNNING:
            return 0, False
        view, windows = self._views_of(request)
        if request.skip_reading_prefix_cache:  # vLLM sets any answer aside, "not yet" too, and computes it all now
            num_computed_tokens = request.num_tokens  # so nothing is offered, and nothing waited on
        match = self.kvfsm.get_num_new_matched_tokens(view, num_computed_tokens)
        if match is None:
            self._matched.pop(request.request_id, None)
            return None, False
        if self.windows:
            match = self.window_hits.match(view, windows, num_computed_tokens, match)
            if match is None:
                self._matched.pop(request.request_id, None)
                return None, False
        self._matched[request.request_id] = (view, *windows)
        return match

    def _views_of(self, request: "Request") -> tuple[RequestView, tuple[GroupView, ...]]:
        """The request's view and its window groups' views, kept from its first lookup to its finish: a request looked
        up again (deferred, or waiting for room) converts only the block hashes vLLM appended since, where a view made
        anew converts its whole prompt's each time. Kept per `Request` object, so a request id reused by another
        request gets views of its own."""
        views = self._views.get(request.request_id)
        if views is None or not views[0].wraps(request):
            view = RequestView(request, self.codec)
            self.tracked.make_all(request.request_id, (g.label for g in self.groups))
            views = (view, tuple(GroupView(view, g, self.codec) for g in self.windows))
            self._views[request.request_id] = views
        return views

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        self.stats.moved = True
        views = self._matched.pop(request.request_id, None)
        if views is None:
            if num_external_tokens:
                raise UnexpectedAllocation(
                    f"vLLM allocated {num_external_tokens} external tokens for {request.request_id!r} "
                    "without a lookup that offered them")
            return
        block_size = self.kvfsm.config.gpu_block_size
        prompt_end = views[0].num_tokens // block_size * block_size
        first_gpu, _ = self.kvfsm.requests[request.request_id].match or (0, 0)
        end = first_gpu + num_external_tokens // block_size  # where the loaded prefix ends, in every group
        for group, view in zip(self.groups, views):
            tokens = num_external_tokens
            if group.rank and num_external_tokens:
                first, count = self.kvfsm.requests[view.request_id].match or (0, 0)
                tokens = (end - first) * block_size if count else 0
            self.kvfsm.update_state_after_alloc(view, group_block_ids(blocks, group), tokens,
                                                store_from=group.first_kept(prompt_end, block_size),
                                                state_of=request.request_id if group.state else None)
        if len(views) > 1:
            self._waiting[request.request_id] = {v.request_id for v in views
                                                 if self.kvfsm.requests[v.request_id].state == RequestState.LOADING}

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """vLLM's indexes of the groups whose blocks of the request's hit are all there once kvfsm's load lands: every
        block the load writes or vLLM holds on its GPU already (`loaded-groups`).

        vLLM asks only after a lookup offered tokens: before it allocates them (a group outside the answer has its
        load's blocks zeroed in the allocating step, before the load, which waits on every kernel enqueued then; a
        DeepSeek-V4.1 bounded-replay group outside it is recomputed from the hit's last window, or a hit no longer
        than that window set aside) and again once an asynchronous load ended (whether to recompute that window).
        vLLM's default, its prefix-cacheable groups, leaves the bounded-replay windows out though kvfsm loads them, so
        vLLM recomputed them; one told loaded that was not would be read unwritten. The answer is read from kvfsm's
        plan for the request: each group's lookup (`match`) until vLLM allocated it, then the load it started
        (`restored`). Every group's load ends where the first group's does (`match_together`), so a group is restored
        when its load starts no later than its window's first block at the hit's end (`Group.first_kept`) or, for a
        group vLLM caches on its GPU, the GPU prefix's end (vLLM holds the blocks below); a bounded-replay window begun
        below the GPU prefix's end is restored when its lookup asked for its whole window (`WindowHits.load_start`)."""
        block_size = self.kvfsm.config.gpu_block_size
        first, end = self._load_span(self.groups[0], request.request_id)
        loaded = []
        for group in self.groups:
            start, _ = self._load_span(group, request.request_id)
            held = first if group.gpu_cached else 0
            if start <= max(held, group.first_kept(end * block_size, block_size)):
                loaded.append(group.index)
        return tuple(loaded)

    def _load_span(self, group: Group, req_id: str) -> tuple[int, int]:
        """The GPU blocks `[first, end)` kvfsm's plan loads for the request's group: its lookup's offer until vLLM
        allocated it, then the load it started."""
        record = self.kvfsm.requests[group.request_id(req_id)]
        if record.match is not None:
            first, count = record.match
            return first, first + count
        _, first, end = record.restored
        return first, end

    def build_connector_meta(self, output: "SchedulerOutput") -> KvfsmMetadata:
        """The step's orders. A step vLLM scheduled, finished and preempted nothing in (an idle step) changes no
        block table, slides no window and moves no counter, so kvfsm is handed the one empty schedule
        (`NOTHING_SCHEDULED`)."""
        if output.num_scheduled_tokens or output.finished_req_ids or output.preempted_req_ids:
            self.stats.moved = True
            self.block_tables.update(output)
            before = computed_before(output)
            if self.windows:
                self._slide(output, before)
            scheduled = scheduler_output(output, self.block_tables, before)
        else:
            scheduled = NOTHING_SCHEDULED
        orders = self.kvfsm.build_connector_meta(scheduled)
        if orders.tier_orders:
            self.tier_index.ordered(orders.tier_orders, self.kvfsm.tier_jobs)
        return KvfsmMetadata(orders, tier_discards=self.tier_index.take_discards())

    def _slide(self, output: "SchedulerOutput", before: dict[str, int]) -> None:
        """Tell kvfsm which blocks vLLM took back this step from each scheduled request's sliding windows (vLLM
        frees what a window no longer reads as it allocates the step, by the same arithmetic, counting only the
        tokens whose step's output it has processed: under async scheduling a step in flight still reads below)."""
        block_size = self.kvfsm.config.gpu_block_size
        tables, requests = self.block_tables, self.kvfsm.requests
        processed = {r: before[r] - requests[r].view.in_flight_tokens for r in output.num_scheduled_tokens}
        for group in self.windows:
            for req_id in output.num_scheduled_tokens:
                tracked = group.request_id(req_id)
                left = tables.left_behind(tracked, group.first_kept(processed[req_id], block_size), NULL_BLOCK)
                if left:
                    self.kvfsm.slide(tracked, left)
                record = self.kvfsm.requests[tracked]
                if record.slid:  # a block handed back to the same request later in its table is its own again
                    record.slid.difference_update(tables[tracked])

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = output.kv_connector_worker_meta
        if meta is not None and not isinstance(meta, KvfsmWorkerMetadata):
            raise TypeError(f"expected kvfsm worker metadata, got {type(meta).__name__}")
        result = self.kvfsm.update_connector_output(ConnectorOutput(workers=meta.reports) if meta else NO_REPORTS)
        if meta is not None:  # without a report no job ended, no rank evicted a key or told its scheme
            self.stats.moved = True
            self.tier_index.settle(meta.evicted, meta.namespaces)
        if result is NOTHING_ENDED:  # an idle step's (and most others'): nothing for vLLM
            return
        self.kvfsm.get_block_ids_with_load_errors()  # the workers reported these blocks to vLLM themselves
        loaded, released = self._whole(result.loaded), self._whole(result.released)
        if loaded and not self.kvfsm.inline_loads:  # an inline load's request is running already
            output.finished_recving = set(output.finished_recving or ()) | loaded
        if released:
            output.finished_sending = set(output.finished_sending or ()) | released

    def _whole(self, tracked_ids: set[str]) -> set[str]:
        """The requests all of whose groups are done with what vLLM waits for (a load, or draining after one): a
        group's news alone is held back until the request's last group's arrives."""
        if not self.windows:
            return tracked_ids
        done = set()
        for tracked in tracked_ids:
            req_id, _ = self.tracked.owner(tracked)
            waiting = self._waiting.get(req_id)
            if waiting is not None:
                waiting.discard(tracked)
                if waiting:
                    continue
                del self._waiting[req_id]
            done.add(req_id)
        for req_id in done - self._views.keys():  # ended, and its last group's news is told
            self.tracked.forget(req_id)
        return done

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """Every group of the request ends; vLLM keeps all its blocks while any group's load still writes them."""
        self._matched.pop(request.request_id, None)
        self._views.pop(request.request_id, None)
        aborted = request.status not in _NORMAL_FINISH
        held = {g.request_id(request.request_id) for g in self.groups
                if self.kvfsm.request_finished(g.request_id(request.request_id), aborted=aborted)}
        if self.windows and held:
            self._waiting[request.request_id] = held
        else:
            self._waiting.pop(request.request_id, None)
            self.tracked.forget(request.request_id)
        return bool(held), None

    def take_events(self) -> Sequence[KVCacheEvent]:
        """The events since the last call; none at all unless vLLM asked for KV events (`kv_events`: kvfsm records
        them only then)."""
        return list(self._events()) if self.kvfsm.config.kv_events else ()

    def _events(self) -> Iterable[KVCacheEvent]:
        """The CPU pool's events (`MEDIUM_CPU`), then each lower tier's (`MEDIUM_STORAGE`, `tier_events`); only vLLM's
        own hashes (the first group's) are announced, a sliding group's keys being kvfsm's."""
        width = self.codec.width or 0
        for event in self.kvfsm.manager.take_events():
            if hashes := tuple(h for h in event.hashes if is_first_group_key(h, width)):
                yield to_vllm(replace(event, hashes=hashes), self.codec.to_bytes, MEDIUM_CPU)
        for tier in self.tier_index.tiers:
            for event in tier.take_events():
                if hashes := tuple(h for h in event.hashes if is_first_group_key(h, width)):
                    yield to_vllm(replace(event, hashes=hashes), self.codec.to_bytes, MEDIUM_STORAGE, tier.locality,
                                  tier.name)

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
