"""One connector's lifecycle objects, and the one place the spec's couplings between them land.

The spec declares how lifecycles move each other (`couplings:` in `spec/*.yaml`): a store's completion
makes its CPU slots ready, unfences the GPU blocks it read and tells its request; a preemption flushes the request's
stores; a write-back's or a fetch's end (a tier job's) moves its CPU slots.
The machines carry those couplings out as effects that call `Ledger.couple`, which fires the named trigger on the
related objects of one table, in one batch, through that table's machine. What the scheduler half and the tier
planner write by hand is only planning: which slots a store or a fetch takes, which blocks a load reads or a
write-back copies down.

Transfer jobs and tier jobs share one id space and one history policy (`keep_history`): with it, every job of the run
stays and the failed ones are noted reported (the invariants read them); without it, a job is forgotten as it ends,
so nothing the ledger keeps grows with the number of jobs.

The indexes beside the tables (the catalogue and free list inside the pool, the jobs each request has in flight,
the stores to flush, what the step tells the engine) are updated here from the transition that was taken, never
by a second copy of the states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from kvfsm.connector.due import StoreDue
from kvfsm.connector.fences import GpuFences
from kvfsm.invariants import Deferral
from kvfsm.machines import MachineSet
from kvfsm.manager import OffloadingManager
from kvfsm.records import FLUSHABLE_JOB_STATES, RequestRecord, TransferJob
from kvfsm.tier_records import TierJob
from kvfsm.states import CpuBlockState, RequestState, TierJobState, TransferJobState

JOB_ENDS = frozenset({TransferJobState.DONE, TransferJobState.FAILED})
TIER_JOB_ENDS = frozenset({TierJobState.DONE, TierJobState.FAILED, TierJobState.SHED})
_WRITING = frozenset({CpuBlockState.PENDING_STORE, CpuBlockState.SUBMITTED, CpuBlockState.FETCHING})
ENDS_OF_JOBS = frozenset({"job-done", "load-done", "load-failed"})
"""Request triggers a job's end fires: a release they cause is news to the engine, unlike one by finish/abort."""


@dataclass
class StepResult:
    """What `update_connector_output` tells the engine."""

    loaded: set[str] = field(default_factory=set)
    """Requests whose load finished (ok or failed): they may be scheduled for compute."""
    released: set[str] = field(default_factory=set)
    """Requests that were draining (the engine held their blocks for a load) and have nothing in flight any more:
    their GPU blocks may be freed. A returned request's end is not news: the engine freed its blocks already."""
    load_errors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """GPU blocks whose load failed, per request: the engine recomputes them."""


NOTHING_ENDED = StepResult(frozenset(), frozenset(), {})  # type: ignore[arg-type]
"""The result of a step whose reports ended nothing (every idle step's): one shared object, never added to."""


class Ledger:
    """Every CPU block, GPU fence, transfer job, tier job and request of one connector, and their machines."""

    def __init__(self, machines: MachineSet, pool: OffloadingManager, keep_history: bool = False,
                 num_gpu_blocks: int = 0) -> None:
        self.fences = GpuFences(machines["gpu-block"], num_gpu_blocks)
        self.jobs: dict[int, TransferJob] = {}
        """Jobs in flight (every job of the run with `keep_history`)."""
        self.store_blocks_in_flight = 0
        """CPU blocks of the stores in flight: what back-pressure bounds (`stores-bounded`), kept as they start and
        end rather than summed over the table, which holds every job of the run with `keep_history`."""
        self.tier_jobs: dict[int, TierJob] = {}
        """Write-backs and fetches in flight, abandoned ones included (every one of the run with `keep_history`)."""
        self._tier_slots: dict[int, int] = {}
        """The tier job in flight on each CPU slot it moves: whom a lookup that meets the slot busy waits for."""
        self.tracked: dict[str, RequestRecord] = {}
        """Requests not yet released: the ones an engine may name."""
        self.requests: dict[str, RequestRecord] = {} if keep_history else self.tracked
        """Requests not yet released (every request of the run with `keep_history`)."""
        self.due = StoreDue()
        """Each tracked request's computed-token count at which its next CPU block completes: beside the records,
        not in them, so that a step reads every request's in one C-level pass."""
        self.deferrals: dict[str, Deferral] = {}
        self.reported_failed: set[int] = set()
        """Failed jobs (transfer and tier) reported to the scheduler; kept with the history it is checked against,
        else not at all."""
        self.keep_history = keep_history
        self.result = StepResult()
        self.flushed: list[TransferJob] = []
        """Stores flushed since the last metadata: the workers submit and wait for them before blocks are reused."""
        self._pool = pool
        self._job, self._tier_job, self._request = machines["transfer-job"], machines["tier-job"], machines["request"]
        self._tables: dict[str, Callable[..., None]] = {
            "cpu-block": pool.fire,
            "gpu-block": self.fences.fire,
            "transfer-job": self._fire_jobs,
            "request": self._fire_requests,
        }

    # --- firing --------------------------------------------------------------------------------------------

    def fire_job(self, job: TransferJob, trigger: str, **context: Any) -> None:
        self._fire_job(job, trigger, ledger=self, **context)

    def fire_request(self, record: RequestRecord, trigger: str, **context: Any) -> str:
        return self._fire_request(record, trigger, ledger=self, **context)

    def fire_tier_job(self, job: TierJob, trigger: str, **context: Any) -> str:
        """Move a write-back or a fetch; the spec's couplings move its CPU slots."""
        dest = self._tier_job.fire(job, trigger, ledger=self, **context)
        if dest in TIER_JOB_ENDS:
            for slot in job.cpu_slots:
                if self._tier_slots.get(slot) == job.job_id:
                    del self._tier_slots[slot]
            self._retire(self.tier_jobs, job.job_id, dest == TierJobState.FAILED)
        return dest

    def couple(self, lifecycle: str, trigger: str, keys: Iterable[Any], **context: Any) -> None:
        """What a coupling effect calls: fire `trigger` on the `lifecycle` objects named by `keys`."""
        self._tables[lifecycle](trigger, keys, **context)

    def _fire_jobs(self, trigger: str, job_ids: Iterable[int], **context: Any) -> None:
        for job_id in job_ids:
            self._fire_job(self.jobs[job_id], trigger, **context)

    def _fire_requests(self, trigger: str, req_ids: Iterable[str], **context: Any) -> None:
        for req_id in req_ids:
            self._fire_request(self.requests[req_id], trigger, **context)

    def _fire_job(self, job: TransferJob, trigger: str, **context: Any) -> None:
        record = self.requests[job.req_id]
        dest = self._job.fire(job, trigger, **context)
        if dest == TransferJobState.FLUSHED_ON_PREEMPT:
            self.flushed.append(job)
        elif dest in JOB_ENDS:
            del record.jobs[job.job_id]
            if job.kind == "store":
                self.store_blocks_in_flight -= len(job.cpu_slots)
            self._retire(self.jobs, job.job_id, dest == TransferJobState.FAILED)

    def _retire(self, table: dict[int, Any], job_id: int, failed: bool) -> None:
        """The one history policy for a job that ended: kept, a failure noted reported, with `keep_history`; else
        forgotten, nothing of it left."""
        if not self.keep_history:
            del table[job_id]
        elif failed:
            self.reported_failed.add(job_id)

    def _fire_request(self, record: RequestRecord, trigger: str, **context: Any) -> str:
        held = record.state == RequestState.DRAINING  # a returned request's blocks are the engine's already
        dest = self._request.fire(record, trigger, **context)
        if trigger == "load-done" or trigger == "load-failed":
            if dest == RequestState.RUNNING:
                self.result.loaded.add(record.req_id)
                if record.failed_blocks:
                    self.result.load_errors[record.req_id] = record.failed_blocks
                    record.failed_blocks = ()
        if dest == RequestState.RELEASED:
            if held and trigger in ENDS_OF_JOBS:
                self.result.released.add(record.req_id)
            self.deferrals.pop(record.req_id, None)
            del self.tracked[record.req_id]
            self.due.forget(record.req_id)
        return dest

    # --- records -------------------------------------------------------------------------------------------

    def track(self, record: RequestRecord) -> None:
        """A request the engine named for the first time (or again after it was released)."""
        self.tracked[record.req_id] = self.requests[record.req_id] = record
        self.due.set(record.req_id, 0)  # not allocated yet: the step looks at it, and plans nothing

    def add_job(self, job: TransferJob) -> None:
        self.jobs[job.job_id] = job
        if job.kind == "store":
            self.store_blocks_in_flight += len(job.cpu_slots)
        self.requests[job.req_id].jobs[job.job_id] = job

    def add_tier_job(self, job: TierJob) -> None:
        self.tier_jobs[job.job_id] = job
        for slot in job.cpu_slots:
            self._tier_slots[slot] = job.job_id

    def tier_blockers(self, slots: Iterable[int]) -> set[int]:
        """Tier jobs in flight on these CPU slots: what a request that met them busy waits for."""
        return {self._tier_slots[s] for s in slots if s in self._tier_slots}

    def fence_handed_out(self, written: Iterable[int], step: int) -> None:
        """lazy-fence: the freed-while-read blocks a step hands out (`written`: its scheduled requests' blocks, which
        its compute may write; and the blocks allocated for it, which its loads may write) are fenced again, and every
        store still reading one is flushed in this step's metadata, so the workers wait for it before the step's
        writes. Such a store is a tracked request's: a request with a store in flight is never released."""
        handed = self.fences.take_handed_out(written)
        if not handed:
            return
        self.fences.fire("reuse", sorted(handed))
        self.flush_readers(handed, step)

    def flush_readers(self, blocks: set[int], step: int) -> None:
        """Flush every store not flushed yet that reads one of `blocks`."""
        for record in list(self.tracked.values()):
            for job in [j for j in record.jobs.values() if j.kind == "store" and j.state in FLUSHABLE_JOB_STATES]:
                if not blocks.isdisjoint(job.gpu_blocks):
                    self.fire_job(job, "flush", step=step)

    def stands(self, record: RequestRecord, step: int) -> bool:
        """`standing-deferral`: whether the deferred request's deferral still answers its lookup, because every job it
        waits on is still in flight. If so the answer is noted (`RequestRecord.standing`, what the invariant reads)
        and nothing else happens: no lookup, no transition (the request machine would take deferred -> deferred, a
        self-loop), no new deferral. If not, a real lookup follows and the note is cleared."""
        record.standing = step if self._deferral_stands(record) else None
        return record.standing is not None

    def _deferral_stands(self, record: RequestRecord) -> bool:
        """None of the deferral's jobs has a finish step (a job forgotten as it ended has ended). A deferral with no
        blockers never stands: nothing would end it."""
        deferral = self.deferrals.get(record.req_id)
        if deferral is None or record.state != RequestState.DEFERRED or not deferral.blockers:
            return False
        jobs, tier_jobs = self.jobs, self.tier_jobs
        for job_id in deferral.blockers:
            job = jobs.get(job_id) or tier_jobs.get(job_id)
            if job is None or job.finished_step is not None:
                return False
        return True

    def blockers(self, busy_slots: Iterable[int]) -> frozenset[int]:
        """The jobs a deferred lookup waits for: the store or fetch writing, the load or write-back reading, each
        busy CPU slot it met."""
        blocks, slots = self._pool.blocks, list(busy_slots)
        jobs = {blocks[s].writer_job if blocks[s].state in _WRITING else blocks[s].reader_job for s in slots}
        jobs.discard(None)
        return frozenset(jobs | self.tier_blockers(slots))  # type: ignore[arg-type]

    def take_flushed(self) -> tuple[int, ...]:
        flushed, self.flushed = self.flushed, []
        return tuple(job.job_id for job in flushed)

    def take_result(self) -> StepResult:
        """What the reports since the last call did; `NOTHING_ENDED` when they ended nothing (the collector is kept,
        empty, for the next step)."""
        result = self.result
        if not (result.loaded or result.released or result.load_errors):
            return NOTHING_ENDED
        self.result = StepResult()
        return result
