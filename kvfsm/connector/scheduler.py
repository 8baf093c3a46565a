"""The connector's scheduler half: which prompt blocks reload from CPU, which blocks to store, what finished.

Shaped like vLLM's KV-connector scheduler API so an adapter only converts types. This module only plans: which
blocks a lookup offers, which slots a load reads and a store takes, which jobs to order. Every lifecycle change
goes through the connector's `Ledger`, whose machines carry out the spec's couplings (a job's end moves its CPU
slots, its GPU fences and its request); nothing here branches on another lifecycle's state to keep them in step.

Timing the spec relies on: a store ordered in step N is submitted by the workers at the start of step N+1, so
the scheduler moves it to `submitted` when it builds step N+1's metadata; a preempted request's stores are flushed
in the next metadata, which the worker executes before the engine reuses any GPU block.

A hit cut to where an engine's other KV-cache groups of the same request can load too: `GroupOffers`, a base class
(kvfsm.connector.group_offers).

Freed blocks are fenced lazily (`lazy-fence`): a request finished or aborted with only stores in flight gives its
GPU blocks back at once; the step that hands one out again flushes the stores still reading it (`Ledger`).

Cost: a step reads its scheduled requests column by column in C (`check_step`: one comparison per request with
`StoreDue`); Python work goes only to the requests that completed a CPU block, and per CPU block to a
bounded number of batched transitions.
"""

from __future__ import annotations

import time
from itertools import chain, islice
from typing import Sequence

from kvfsm.bindings import default_spec
from kvfsm.config import OffloadConfig
from kvfsm.connector.admission import Admission
from kvfsm.connector.backpressure import StoreBound
from kvfsm.connector.group_offers import GroupOffers
from kvfsm.connector.ledger import Ledger, StepResult
from kvfsm.connector.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    LoadOrder,
    SchedulerOutput,
    StoreOrder,
)
from kvfsm.connector.ranks import every_rank_verdict, rank_reports
from kvfsm.connector.refusals import StaleMatch
from kvfsm.connector.request_view import RequestView
from kvfsm.connector.stats import ConnectorStats
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.connector.validation import (
    UnknownRequest,
    check_alloc,
    check_finished,
    check_lookup,
    check_reports,
    check_scheduler,
    check_slide,
    check_step,
)
from kvfsm.invariants import Deferral
from kvfsm.machines import MachineSet
from kvfsm.manager import NotLoadable, OffloadingManager
from kvfsm.records import FLUSHABLE_JOB_STATES, RequestRecord, TransferJob
from kvfsm.states import RequestState, TransferJobState
from kvfsm.tiers.base import LowerTier

__all__ = ["RequestView", "SchedulerConnector", "StepResult", "UnknownRequest"]


class SchedulerConnector(GroupOffers):
    def __init__(self, config: OffloadConfig, gpu_block_bytes: int, machines: MachineSet | None = None,
                 keep_history: bool = False, num_gpu_blocks: int | None = None,
                 tiers: Sequence[LowerTier] = ()) -> None:
        """`keep_history`: keep ended jobs and released requests (for invariant checks); `num_gpu_blocks`: the
        engine's KV-cache size, so block ids beyond it are refused (None: not checked) and each block's fence
        record is made up front; `tiers`: the lower tiers below the CPU pool, looked up in this order (opened by
        the worker half of this process). KV-cache events are recorded when `config.kv_events` is on, for an
        engine that drains them (`manager.take_events()`) every step."""
        check_scheduler(config, gpu_block_bytes, num_gpu_blocks)
        self.config = config
        self.gpu_block_bytes = gpu_block_bytes
        self.num_gpu_blocks = num_gpu_blocks
        self.machines = machines or MachineSet(default_spec())
        self.manager = OffloadingManager(config.num_cpu_blocks(gpu_block_bytes), config.eviction, self.machines,
                                         events=config.kv_events)
        self.ledger = Ledger(self.machines, self.manager, keep_history, num_gpu_blocks or 0)
        self.stats = ConnectorStats()
        self.admission = Admission(config)
        self.store_bound = StoreBound(config.store_max_blocks_in_flight, self.ledger, self.stats)
        self.step = 0
        self._next_job = 0
        self._new_loads: list[TransferJob] = []
        self._prepared: list[TransferJob] = []
        self._load_errors: set[int] = set()
        self._cpu_block_tokens = config.cpu_block_tokens
        self.outputs = 0
        """Engine outputs taken by `update_connector_output` so far: step N's output is the N-th, even when the
        engine schedules step N+1 before it (async scheduling)."""
        self.inline_loads = config.inline_loads
        """Whether this half answers a CPU hit as a load computed in its own step, decided once at start-up: with
        `layer_loads`, unless the engine schedules ahead (`no-inline-load-under-async-scheduling`)."""
        self.load_reports_in_step = False
        """Set by an engine that reads a failed load's blocks only in the output of the step that computed on them
        (vLLM): each load computed in its own step is then due in that step's output (`inline-load-in-step`)."""
        self.tiers = TierPlanner(config, tiers, self.manager, config.block_size_factor * gpu_block_bytes,
                                 self._take_job_id, self.ledger, self.stats) if tiers else None
        """The lower tiers' side of this half (lookup below CPU, fetches, write-backs); None without tiers."""

    # --- lookup and allocation ---------------------------------------------------------------------------

    @property
    def moving_between_tiers(self) -> bool:
        """A write-back or fetch is in flight: the engine keeps stepping (idle steps) until it is reported."""
        return self.tiers is not None and not self.tiers.idle

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool] | None:
        """Tokens loadable from CPU beyond the GPU prefix, and that the load is async; None defers the request.

        A request is deferred while any block it would load is being stored or loaded by someone else: once that
        load lands, the engine's GPU prefix cache serves those blocks and this request loads only the rest. Asked
        again while every job its deferral waits on is in flight, it is answered from that deferral without a lookup
        (`standing-deferral`): "not yet" either way, and one of those jobs' end is what re-examines it.
        """
        check_lookup(self, request, num_computed_tokens)
        record = self._track(request)
        self.stats.lookups += 1
        if self.ledger.stands(record, self.step):  # every job it waits on still in flight: not yet, as it was
            self.stats.deferrals += 1
            return None
        block_size, k = self.config.gpu_block_size, self.config.block_size_factor
        first_gpu = num_computed_tokens // block_size
        first_cpu = first_gpu // k
        # Read in place from `first_cpu` on (no copy of the prompt's hashes): a deferred lookup stops at the first
        # busy block, so a long prompt looked up again each step costs its hits, not its length.
        lookup = self.manager.lookup(islice(request.block_hashes, first_cpu * k + k - 1, None, k), every_busy=False)
        computable = (request.num_tokens - 1) // block_size  # the last token is always computed, for its logits
        if lookup.busy:
            return self._defer(record, self.ledger.blockers(lookup.busy))
        if self.tiers is not None:  # what CPU lacks, a lower tier may hold: fetch it into CPU, look up again then
            fetches = self.tiers.fetch_missing(self._cpu_hashes(request)[first_cpu:computable // k], lookup.hits,
                                               self.step)
            if fetches:
                return self._defer(record, fetches)
        self.ledger.fire_request(record, "lookup", busy=False)
        self.ledger.deferrals.pop(request.request_id, None)
        count = max(0, min((first_cpu + lookup.hits) * k, computable) - first_gpu)
        record.match = (first_gpu, count)
        self.stats.cpu_hit_blocks += count
        if count == 0:
            self.stats.cpu_misses += 1
        return count * block_size, count > 0 and not self.inline_loads

    def _defer(self, record: RequestRecord, blockers: frozenset[int]) -> None:
        """Answer None: the request looks up again next step, once the jobs it waits for can have ended."""
        self.ledger.fire_request(record, "lookup", busy=True)
        self.ledger.deferrals[record.req_id] = Deferral(step=self.step + 1, blockers=blockers)
        self.stats.deferrals += 1
        return None

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int],
                                 num_external_tokens: int, store_from: int = 0, state_of: str | None = None) -> None:
        """The engine allocated `block_ids` (all of the request's GPU blocks); start the load it accepted.
        `store_from`: the first GPU block its stores may read (a sliding-window request's window at its prompt's
        end; the engine's null block stands for every block before the window). `state_of`: the request whose
        prefix this one's blocks are the state of (a state-space group's; `state-at-prefix-end`)."""
        check_alloc(self, request, block_ids, num_external_tokens, store_from, state_of)
        record = self._get(request.request_id)
        assert record.match is not None  # check_alloc read it: a looked-up request's lookup recorded it
        count = num_external_tokens // self.config.gpu_block_size
        k = self.config.block_size_factor
        first_gpu = record.match[0] if count else 0
        first_cpu, offset = divmod(first_gpu, k)
        end_cpu = -(-(first_gpu + count) // k)
        hashes = self._cpu_hashes(request)[first_cpu:end_cpu]
        try:  # pinned before any state changes: the match may have been evicted since the lookup
            slots = self.manager.prepare_load(hashes, self._next_job) if count else ()
        except NotLoadable as gone:
            raise StaleMatch(f"update_state_after_alloc: request {request.request_id!r} accepted {count} blocks its "
                             f"lookup offered, but they left the CPU pool since ({gone}); look it up again") from gone
        record.block_ids = tuple(block_ids)
        record.store_from = store_from
        record.slid = set()  # a resumed request's window starts again from the blocks it was given now
        record.state_of, record.restored = state_of, (self.step, first_gpu, first_gpu + count)
        self.ledger.fences.allocated.extend(record.block_ids)  # handed out in the step the next metadata is for
        record.stored_cpu_blocks = 0
        self.ledger.due.set(record.req_id, self._cpu_block_tokens)
        record.match = None
        inline = self.inline_loads
        self.ledger.fire_request(record, "allocate", external_tokens=count, inline=inline)
        if count == 0:
            return
        self.manager.touch(hashes)
        if self.tiers is not None:
            end, size = first_gpu + count, self.config.gpu_block_size
            self.tiers.loaded(slots, [size * (min(end, (i + 1) * k) - max(first_gpu, i * k))
                                       for i in range(first_cpu, end_cpu)])
        job = self._new_job("load", request.request_id, record.block_ids[first_gpu:first_gpu + count], slots,
                            hashes, gpu_offset=offset)
        job.inline = inline
        if inline and self.load_reports_in_step:
            job.due_output = self.step + 1  # submitted by the next metadata, which is step + 1's
        self.stats.record_load_started(inline)
        self._new_loads.append(job)

    # --- the step's orders ---------------------------------------------------------------------------------

    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata:
        """This step's loads, the stores to prepare after its forward pass, and the stores to flush first."""
        due = check_step(self, output)
        self.step += 1
        if self._nothing_to_order(output):  # only the step, and the tiers' orders if any (validated: cheapest)
            return ConnectorMetadata(step=self.step, tier_orders=self.tiers.orders(self.step) if self.tiers else ())
        ledger = self.ledger
        for req_id in output.preempted:
            ledger.fire_request(self._get(req_id), "preempt")
        ledger.fence_handed_out(chain.from_iterable(output.block_ids), self.step)
        flush = ledger.take_flushed()
        for job in self._prepared:  # ordered last step, submitted by the workers as this step starts
            if job.state == TransferJobState.PENDING_STORE:
                ledger.fire_job(job, "submit", step=self.step)
        self._prepared = []
        tier_orders = self.tiers.orders(self.step) if self.tiers is not None else ()
        loads = []
        for job in self._new_loads:
            ledger.fire_job(job, "submit", step=self.step)
            loads.append(LoadOrder.model_construct(job_id=job.job_id, req_id=job.req_id, gpu_blocks=job.gpu_blocks,
                                                   cpu_slots=job.cpu_slots, gpu_offset=job.gpu_offset))
        self._new_loads = []
        stores = []
        for record, block_ids, computed in due:  # check_step read the batch in C; only these completed a CPU block
            order = self._order_store(record, block_ids, computed)
            if order is not None:
                stores.append(order)
        # Built from records this connector validated itself: construct without re-validating (a StoreOrder per
        # running request per step made validation the scheduler half's largest cost); a worker in another
        # process validates on `model_validate_json`.
        return ConnectorMetadata.model_construct(step=self.step, loads=tuple(loads), stores=tuple(stores),
                                                 flush=flush, tier_orders=tier_orders)

    def _nothing_to_order(self, output: SchedulerOutput) -> bool:
        """An idle step: no request scheduled or preempted, nothing to fence, flush, submit or load."""
        ledger = self.ledger
        return not (output.req_ids or output.preempted or self._new_loads or self._prepared or ledger.flushed
                    or ledger.fences.allocated)

    def _order_store(self, record: RequestRecord, block_ids: Sequence[int],
                     num_computed_tokens: int) -> StoreOrder | None:
        """Store the request's newly completed whole CPU blocks that the pool does not hold yet."""
        if record.state != RequestState.RUNNING:
            return None
        k = self.config.block_size_factor
        cpu_hashes = self._cpu_hashes(record.view)
        full_cpu = min(num_computed_tokens // self._cpu_block_tokens, len(cpu_hashes), len(block_ids) // k)
        start = max(record.stored_cpu_blocks, -(-record.store_from // k))
        record.stored_cpu_blocks = max(start, full_cpu)
        self.ledger.due.set(record.req_id, (record.stored_cpu_blocks + 1) * self._cpu_block_tokens)
        if full_cpu <= start:
            return None
        parent = cpu_hashes[start - 1] if start else None
        verdict = self.admission.offer(record, start, cpu_hashes[start:full_cpu], self.manager.catalogue, parent)
        for reason, skipped in verdict.skipped.items():
            self.ledger.fire_request(record, "skip-store", hashes=skipped, reason=reason)
            self.stats.record_skipped(reason, len(skipped))
        admitted = self.store_bound.admit(record, verdict.admitted, self.manager.catalogue, verdict.readmitted)
        if not admitted:
            return None
        plan = self.manager.prepare_store(admitted, self._next_job)
        if plan is None:
            self.stats.store_refusals += 1
            return None
        if not plan.hashes:
            return None
        if len(plan.hashes) == full_cpu - start:  # the pool held none of them, none skipped: the blocks are one run
            gpu_blocks = tuple(block_ids[start * k:full_cpu * k])
        else:
            wanted = set(plan.hashes)
            gpu_blocks = tuple(b for i in range(start, full_cpu) if cpu_hashes[i] in wanted
                               for b in block_ids[i * k:(i + 1) * k])
        job = self._new_job("store", record.req_id, gpu_blocks, plan.slots, plan.hashes)
        self.ledger.fire_job(job, "prepare")
        self._prepared.append(job)
        return StoreOrder.model_construct(job_id=job.job_id, req_id=record.req_id, gpu_blocks=gpu_blocks,
                                          cpu_slots=job.cpu_slots)

    # --- completions -----------------------------------------------------------------------------------

    def update_connector_output(self, output: ConnectorOutput) -> StepResult:
        """Log each rank's reports (all checked first: one bad report applies none) and finish the jobs every rank
        reported; a job fails if any rank failed it."""
        check_reports(self, output)
        self.outputs += 1
        if self._load_errors:
            self._load_errors = set()
        for rank, job, ok in rank_reports(output, self.ledger.jobs):
            job.reports[rank] = ok
            verdict = self._verdict(job)
            if verdict is not None:
                self._finish(job, verdict)
        for worker in output.workers:
            for report in worker.tiers:
                self.tiers.report(worker.worker, report, self.step)  # type: ignore[union-attr]
        result = self.ledger.take_result()
        for blocks in result.load_errors.values():
            self._load_errors.update(blocks)
        return result

    def _verdict(self, job: TransferJob) -> bool | None:
        """Whether the job succeeded on every rank, once every rank reported it (the TP controls replace this)."""
        return every_rank_verdict(job, self.config.num_workers)

    def _finish(self, job: TransferJob, ok: bool) -> None:
        """The job's end; the spec's couplings move its CPU slots, its GPU fences and its request."""
        self.ledger.fire_job(job, "complete" if ok else "fail", step=self.step)
        seconds = time.perf_counter() - job.submitted_at
        job.reported_output = self.outputs
        if job.kind == "store":
            if ok and self.tiers is not None:
                self.tiers.stored(job.hashes)
            self.stats.record_store(len(job.cpu_slots), ok, self.config.block_size_factor * self.gpu_block_bytes,
                                    seconds)
        else:
            self.stats.record_load(len(job.gpu_blocks), ok, self.gpu_block_bytes, seconds)

    def request_finished(self, request_id: str, aborted: bool = False) -> bool:
        """Whether the engine must keep the request's GPU blocks until `update_connector_output` releases it: only
        while its load still writes them. With stores alone in flight the blocks go back at once (the request is
        `returned`; the step that hands one out again fences it, `lazy-fence`), and its end is not reported.

        Engines call this for every request that ends, including ones the connector never looked up."""
        check_finished(self, request_id, aborted)
        record = self.ledger.tracked.get(request_id)
        if record is None:
            return False
        return self.ledger.fire_request(record, "abort" if aborted else "finish") == RequestState.DRAINING

    def slide(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The engine took back these blocks of a running request, out of its sliding window: those its stores still
        read are freed-while-read until a step hands them out (`window-fence`)."""
        check_slide(self, request_id, block_ids)
        self.ledger.fire_request(self._get(request_id), "slide", blocks=tuple(block_ids))

    def reset_cache(self) -> None:
        """Forget every CPU block; stores in flight are flushed and their late completions free, never publish."""
        self.manager.reset()
        if self.tiers is not None:
            self.tiers.reset()
        for job in list(self.ledger.jobs.values()):
            if job.kind == "store" and job.state in FLUSHABLE_JOB_STATES:
                self.ledger.fire_job(job, "flush", step=self.step)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose load failed in the last `update_connector_output`, once (the engine recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- helpers ---------------------------------------------------------------------------------------

    def _take_job_id(self) -> int:
        """A job id for a tier job: one id space with transfer jobs, so a deferral's blockers name either."""
        job_id = self._next_job
        self._next_job += 1
        return job_id

    def _new_job(self, kind: str, req_id: str, gpu_blocks: Sequence[int], cpu_slots: Sequence[int],
                 hashes: Sequence[int], gpu_offset: int = 0) -> TransferJob:
        job = TransferJob(job_id=self._next_job, kind=kind, req_id=req_id,  # type: ignore[arg-type]
                          gpu_blocks=tuple(gpu_blocks), cpu_slots=tuple(cpu_slots), hashes=tuple(hashes),
                          gpu_offset=gpu_offset, ordered_step=self.step)
        self._next_job += 1
        self.ledger.add_job(job)
        return job

    def _cpu_hashes(self, request: RequestView) -> Sequence[int]:
        """A CPU block's hash is the hash of its last GPU block: the chain makes it cover the whole prefix."""
        k = self.config.block_size_factor
        hashes = request.block_hashes
        return hashes[k - 1::k] if k > 1 else hashes

    def _track(self, request: RequestView) -> RequestRecord:
        record = self.ledger.tracked.get(request.request_id)
        if record is None:
            record = RequestRecord(request.request_id,
                                   prompt_cpu_blocks=request.num_tokens // self._cpu_block_tokens)
            self.ledger.track(record)
        record.view = request
        return record
