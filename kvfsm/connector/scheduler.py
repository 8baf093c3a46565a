"""The connector's scheduler half: which prompt blocks reload from CPU, which blocks to store, what finished.

Shaped like vLLM's KV-connector scheduler API so an adapter only converts types. Every lifecycle change goes
through the machines built from the spec: requests (lookup, allocate, preempt, finish, abort), transfer jobs
(prepare, submit, flush, complete, fail), GPU-block fences, and — through the manager — CPU blocks.

Timing the spec relies on: a store ordered in step N is submitted by the workers at the start of step N+1, so
the scheduler moves it to `submitted` when it builds step N+1's metadata; a preempted or aborted request's
stores are flushed in the next metadata, which the worker executes before the engine reuses any GPU block.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from kvfsm.config import OffloadConfig
from kvfsm.connector.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    LoadOrder,
    SchedulerOutput,
    StoreOrder,
)
from kvfsm.connector.stats import ConnectorStats
from kvfsm.invariants import Deferral
from kvfsm.machines import MachineSet, default_machines
from kvfsm.manager import OffloadingManager
from kvfsm.records import FLUSHABLE_JOB_STATES, GpuBlock, RequestRecord, TransferJob


class RequestView(Protocol):
    """What the connector reads of an engine's request."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[int]:
        """Hash chain over the request's full GPU blocks (block i's hash covers tokens [0, (i+1)·block_size))."""

    @property
    def num_tokens(self) -> int: ...


class UnknownRequest(KeyError):
    """The engine named a request the connector never saw (or already released)."""


class UnknownJob(KeyError):
    """A worker reported a job the scheduler does not track, or reported it twice."""


@dataclass(frozen=True, slots=True)
class _Match:
    """A lookup's answer, kept until the engine allocates GPU blocks for the request."""

    first_gpu_block: int
    num_gpu_blocks: int


@dataclass(slots=True)
class _Tracked:
    request: RequestView
    record: RequestRecord
    block_ids: tuple[int, ...] = ()
    stored_cpu_blocks: int = 0
    match: _Match | None = None


@dataclass
class StepResult:
    """What `update_connector_output` tells the engine."""

    loaded: set[str] = field(default_factory=set)
    """Requests whose load finished (ok or failed): they may be scheduled for compute."""
    released: set[str] = field(default_factory=set)
    """Requests that were draining and have nothing in flight any more: their GPU blocks may be freed."""
    load_errors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """GPU blocks whose load failed, per request: the engine recomputes them."""


class SchedulerConnector:
    def __init__(self, config: OffloadConfig, gpu_block_bytes: int, machines: MachineSet | None = None,
                 keep_history: bool = False) -> None:
        self.config = config
        self.gpu_block_bytes = gpu_block_bytes
        self.machines = machines or default_machines()
        self.manager = OffloadingManager(config.num_cpu_blocks(gpu_block_bytes), config.eviction)
        self.stats = ConnectorStats()
        self.step = 0
        self.keep_history = keep_history
        self.jobs: dict[int, TransferJob] = {}
        self.requests: dict[str, RequestRecord] = {}
        self.gpu_blocks: dict[int, GpuBlock] = {}
        self.deferrals: dict[str, Deferral] = {}
        self.reported_failed: set[int] = set()
        self._tracked: dict[str, _Tracked] = {}
        self._slot_jobs: dict[int, set[int]] = defaultdict(set)
        self._next_job = 0
        self._new_loads: list[TransferJob] = []
        self._prepared: list[TransferJob] = []
        self._to_flush: list[TransferJob] = []
        self._reports: dict[int, dict[int, bool]] = defaultdict(dict)
        self._load_errors: set[int] = set()
        self._submitted_at: dict[int, float] = {}
        self._req, self._job, self._gpu = (self.machines[n] for n in ("request", "transfer-job", "gpu-block"))

    # --- lookup and allocation ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool] | None:
        """Tokens loadable from CPU beyond the GPU prefix, and that the load is async; None defers the request.

        A request is deferred while any block it would load is being stored or loaded by someone else: once that
        load lands, the engine's GPU prefix cache serves those blocks and this request loads only the rest.
        """
        tracked = self._track(request)
        block_size, k = self.config.gpu_block_size, self.config.block_size_factor
        first_gpu = num_computed_tokens // block_size
        first_cpu = first_gpu // k
        lookup = self.manager.lookup(self._cpu_hashes(request)[first_cpu:])
        self.stats.lookups += 1
        if lookup.busy:
            self._req.fire(tracked.record, "lookup", busy=True)
            blockers = frozenset(j for slot in lookup.busy for j in self._slot_jobs.get(slot, ()))
            self.deferrals[request.request_id] = Deferral(step=self.step + 1, blockers=blockers)
            self.stats.deferrals += 1
            return None
        self._req.fire(tracked.record, "lookup", busy=False)
        self.deferrals.pop(request.request_id, None)
        computable = (request.num_tokens - 1) // block_size  # the last token is always computed, for its logits
        count = max(0, min((first_cpu + lookup.hits) * k, computable) - first_gpu)
        tracked.match = _Match(first_gpu, count)
        self.stats.cpu_hit_blocks += count
        if count == 0:
            self.stats.cpu_misses += 1
        return count * block_size, count > 0

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """The engine allocated `block_ids` (all of the request's GPU blocks); start the load it accepted."""
        tracked = self._get(request.request_id)
        tracked.block_ids = tuple(block_ids)
        tracked.stored_cpu_blocks = 0
        match, tracked.match = tracked.match, None
        count = num_external_tokens // self.config.gpu_block_size
        self._req.fire(tracked.record, "allocate", external_tokens=count)
        if count == 0:
            return
        assert match is not None and count <= match.num_gpu_blocks, "engine accepted more than the lookup offered"
        k = self.config.block_size_factor
        first_cpu, offset = divmod(match.first_gpu_block, k)
        end_cpu = -(-(match.first_gpu_block + count) // k)
        hashes = self._cpu_hashes(request)[first_cpu:end_cpu]
        slots = self.manager.prepare_load(hashes)
        self.manager.touch(hashes)
        job = self._new_job(
            "load", request.request_id, tracked.block_ids[match.first_gpu_block:match.first_gpu_block + count],
            slots, hashes, gpu_offset=offset,
        )
        self._new_loads.append(job)

    # --- the step's orders ---------------------------------------------------------------------------------

    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata:
        """This step's loads, the stores to prepare after its forward pass, and the stores to flush first."""
        self.step += 1
        for req_id in output.preempted:
            self._flush(self._get(req_id).record, "preempt")
        flush = tuple(job.job_id for job in self._to_flush)
        for job in self._prepared:  # ordered last step, submitted by the workers as this step starts
            if job.state == "pending-store":
                self._job.fire(job, "submit", step=self.step)
                self.manager.mark_submitted(job.cpu_slots)
                self._submitted_at[job.job_id] = time.perf_counter()
        self._prepared, self._to_flush = [], []
        loads = []
        for job in self._new_loads:
            self._job.fire(job, "submit", step=self.step)
            self._submitted_at[job.job_id] = time.perf_counter()
            loads.append(LoadOrder.model_construct(job_id=job.job_id, req_id=job.req_id, gpu_blocks=job.gpu_blocks,
                                                   cpu_slots=job.cpu_slots, gpu_offset=job.gpu_offset))
        self._new_loads = []
        stores = [order for s in output.scheduled if (order := self._order_store(s.req_id, s.block_ids,
                                                                                   s.num_computed_tokens))]
        # Built from records this connector validated itself: construct without re-validating (a StoreOrder per
        # running request per step made validation the scheduler half's largest cost); a worker in another
        # process validates on `model_validate_json`.
        return ConnectorMetadata.model_construct(step=self.step, loads=tuple(loads), stores=tuple(stores),
                                                 flush=flush)

    def _order_store(self, req_id: str, block_ids: Sequence[int], num_computed_tokens: int) -> StoreOrder | None:
        """Store the request's newly completed whole CPU blocks that the pool does not hold yet."""
        tracked = self._get(req_id)
        tracked.block_ids = tuple(block_ids)
        if tracked.record.state != "running":
            return None
        k = self.config.block_size_factor
        cpu_hashes = self._cpu_hashes(tracked.request)
        full_cpu = min(num_computed_tokens // self.config.cpu_block_tokens, len(cpu_hashes), len(block_ids) // k)
        start, tracked.stored_cpu_blocks = tracked.stored_cpu_blocks, max(tracked.stored_cpu_blocks, full_cpu)
        if full_cpu <= start:
            return None
        job_id = self._next_job
        plan = self.manager.prepare_store(cpu_hashes[start:full_cpu], job_id)
        if plan is None:
            self.stats.store_refusals += 1
            return None
        if not plan.hashes:
            return None
        wanted = set(plan.hashes)
        gpu_blocks = tuple(b for i in range(start, full_cpu) if cpu_hashes[i] in wanted
                           for b in block_ids[i * k:(i + 1) * k])
        job = self._new_job("store", req_id, gpu_blocks, plan.slots, plan.hashes)
        self._job.fire(job, "prepare")
        fences = self.gpu_blocks
        self._gpu.fire_many([fences.get(b) or fences.setdefault(b, GpuBlock(b)) for b in gpu_blocks], "fence")
        self._prepared.append(job)
        return StoreOrder.model_construct(job_id=job.job_id, req_id=req_id, gpu_blocks=gpu_blocks,
                                          cpu_slots=job.cpu_slots)

    # --- completions -----------------------------------------------------------------------------------

    def update_connector_output(self, output: ConnectorOutput) -> StepResult:
        """Complete the jobs every worker reported; a job fails if any worker failed it."""
        result = StepResult()
        for worker in output.workers:
            for job_id, ok in [*((j, True) for j in worker.done), *((j, False) for j in worker.failed)]:
                job = self.jobs.get(job_id)
                if job is None or not job.in_flight or worker.worker in self._reports.get(job_id, {}):
                    raise UnknownJob(f"worker {worker.worker} reported job {job_id}, which is not in flight for it")
                reports = self._reports[job_id]
                reports[worker.worker] = ok
                if len(reports) == self.config.num_workers:
                    self._finish(job, all(reports.values()), result)
                    del self._reports[job_id]
        return result

    def _finish(self, job: TransferJob, ok: bool, result: StepResult) -> None:
        self._job.fire(job, "complete" if ok else "fail", step=self.step)
        seconds = time.perf_counter() - self._submitted_at.pop(job.job_id)
        for slot in job.cpu_slots:
            self._slot_jobs[slot].discard(job.job_id)
        if not ok:
            self.reported_failed.add(job.job_id)
        if job.kind == "store":
            self.manager.complete_store(job.cpu_slots, ok)
            fenced = [self.gpu_blocks[b] for b in job.gpu_blocks]
            self._gpu.fire_many(fenced, "unfence")
            for block in fenced:
                if block.state == "writable":
                    del self.gpu_blocks[block.block_id]
            self.stats.record_store(len(job.cpu_slots), ok, self.config.block_size_factor * self.gpu_block_bytes,
                                    seconds)
        else:
            self.manager.complete_load(job.cpu_slots)
            self.stats.record_load(len(job.gpu_blocks), ok, self.gpu_block_bytes, seconds)
        record = self.requests[job.req_id]
        if record.state == "loading":
            self._req.fire(record, "load-done" if ok else "load-failed")
            result.loaded.add(job.req_id)
            if not ok:
                result.load_errors[job.req_id] = job.gpu_blocks
                self._load_errors.update(job.gpu_blocks)
        elif record.state == "draining":
            if self._req.fire(record, "job-done") == "released":
                result.released.add(job.req_id)
                self._forget(job.req_id)
        del record.jobs[job.job_id]
        if not self.keep_history:
            del self.jobs[job.job_id]

    def request_finished(self, request_id: str, aborted: bool = False) -> bool:
        """Whether the engine must keep the request's GPU blocks until `update_connector_output` releases it.

        Engines call this for every request that ends, including ones the connector never looked up."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return False
        if aborted:
            self._flush(tracked.record, "abort")
        else:
            self._req.fire(tracked.record, "finish")
        if tracked.record.state == "released":
            self._forget(request_id)
            return False
        return True

    def reset_cache(self) -> None:
        """Forget every CPU block; stores in flight are flushed and their late completions free, never publish."""
        self.manager.reset()
        for job in list(self.jobs.values()):
            if job.kind == "store" and job.state in FLUSHABLE_JOB_STATES:
                self._flush_job(job)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- helpers ---------------------------------------------------------------------------------------

    def _flush(self, record: RequestRecord, trigger: str) -> None:
        """Fire preempt/abort; the spec's `flush-stores` effect moves its stores to flushed-on-preempt."""
        pending = [j for j in record.jobs.values() if j.state == "pending-store"]
        before = {j.job_id for j in record.jobs.values() if j.state == "flushed-on-preempt"}
        self._req.fire(record, trigger, job_machine=self._job)
        self._after_flush(pending, [j for j in record.jobs.values()
                                    if j.state == "flushed-on-preempt" and j.job_id not in before])

    def _flush_job(self, job: TransferJob) -> None:
        pending = [job] if job.state == "pending-store" else []
        self._job.fire(job, "flush")
        self._after_flush(pending, [job])

    def _after_flush(self, were_pending: list[TransferJob], flushed: list[TransferJob]) -> None:
        for job in were_pending:  # a flush submits a pending store at once
            self.manager.mark_submitted(job.cpu_slots)
            self._submitted_at[job.job_id] = time.perf_counter()
        self._to_flush.extend(flushed)

    def _new_job(self, kind: str, req_id: str, gpu_blocks: Sequence[int], cpu_slots: Sequence[int],
                 hashes: Sequence[int], gpu_offset: int = 0) -> TransferJob:
        job = TransferJob(job_id=self._next_job, kind=kind, req_id=req_id,  # type: ignore[arg-type]
                          gpu_blocks=tuple(gpu_blocks), cpu_slots=tuple(cpu_slots), hashes=tuple(hashes),
                          gpu_offset=gpu_offset, ordered_step=self.step)
        self._next_job += 1
        self.jobs[job.job_id] = job
        self.requests[req_id].jobs[job.job_id] = job
        for slot in job.cpu_slots:
            self._slot_jobs[slot].add(job.job_id)
        return job

    def _cpu_hashes(self, request: RequestView) -> Sequence[int]:
        """A CPU block's hash is the hash of its last GPU block: the chain makes it cover the whole prefix."""
        k = self.config.block_size_factor
        hashes = request.block_hashes
        return hashes[k - 1::k] if k > 1 else hashes

    def _track(self, request: RequestView) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            record = RequestRecord(request.request_id)
            tracked = self._tracked[request.request_id] = _Tracked(request, record)
            self.requests[request.request_id] = record
        tracked.request = request
        return tracked

    def _get(self, request_id: str) -> _Tracked:
        try:
            return self._tracked[request_id]
        except KeyError:
            raise UnknownRequest(f"request {request_id!r} is not tracked by the connector") from None

    def _forget(self, request_id: str) -> None:
        del self._tracked[request_id]
        self.deferrals.pop(request_id, None)
        if not self.keep_history:
            del self.requests[request_id]
