"""Controls: kvfsm with one guarded rule removed, each the shape of a bug an engine really shipped.

A mutant patches one running engine + connector pair (instance attributes only, nothing global), so the same
generated interleavings run against kvfsm and against each mutant. The suite must find a failing interleaving for
every mutant; a mutant that survives means the checks are too weak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container, Sequence

from kvfsm.connector import Connector, SchedulerConnector, WorkerConnector
from kvfsm.connector.admission import Verdict
from kvfsm.engine.engine import Engine
from kvfsm.executor.device import StreamName
from kvfsm.manager.catalogue import Lookup
from kvfsm.states import CpuBlockState, RequestState, TransferJobState
from kvfsm.records import RequestRecord, TransferJob
from kvfsm.testing.copy_faults import Direction
from kvfsm.testing.mooncake_store import MOONCAKE_MUTANTS
from kvfsm.testing.tier_mutants import TIER_MUTANTS, busy_pool_is_miss


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str
    """The spec invariant (and the public bug) the mutant reintroduces."""
    apply: Callable[[Engine, Connector], None]
    per_layer: bool | None = None
    """The engine the bug needs: True, one that calls the per-layer hooks; False, one that does not; None, any."""
    layer_loads: bool = False
    """Whether the bug needs loads computed in their own step (the connector's `layer_loads`)."""
    layer_stores: bool = False
    """Whether the bug needs stores started by `save_kv_layer`."""
    tier: str | None = None
    """The lower tier (`disk`, `mooncake`) whose rule it breaks: it only shows with that tier configured."""
    store_threshold: int = 1
    """The store threshold the bug needs: only admission that skips blocks shows a skip not applied (the reference
    engine hashes prompt blocks alone, so a threshold is what makes it skip)."""
    fails_part_way: Direction | None = None
    """The copies whose failure part-way through their pipeline the bug needs: the interleavings' hunt for it makes
    every such copy fail after its first piece, stores sent in one-block chunks."""
    store_bound: int | None = None
    """The bound on stores in flight (`store_max_blocks_in_flight`) the bug needs: without a bound it is kvfsm, so its
    interleavings always set this one, and the explorer searches only the workloads that set one."""
    queue_bound: int | None = None
    """The bound on an eager tier's write-back queue (`writeback_max_queued_blocks`) the bug needs: its interleavings
    set this one on an eager tier, and the explorer searches only the workloads that set one."""
    max_cpu_blocks: int | None = None
    """The largest CPU pool the bug shows in: one it shows only when every slot is busy, which a roomy pool hardly
    is. Its interleavings draw pools no larger, and the explorer searches only such workloads."""
    load_lags: bool = False
    """Whether the bug needs the load stream stalled part-way through a load while compute runs on, which the
    drawn stream choices and holds make rarely (once in hundreds to thousands of examples): its interleavings get a
    rule that makes it (`OffloadInterleavings`' `lag_a_load`)."""


def _no_compute_barrier(engine: Engine, connector: Connector) -> None:
    stores = connector.worker._stores
    stores._wait_for_compute = lambda compute_done: None  # type: ignore[method-assign]


def _no_preemption_flush(engine: Engine, connector: Connector) -> None:
    connector.worker.handle_preemptions = lambda: None  # type: ignore[method-assign]


def _flush_waits_only_for(connector: Connector, choose: Callable[[], Callable[[int], bool]]) -> None:
    """The preemption hook waits only for the flushed stores a predicate keeps (`choose` makes it as the hook
    starts)."""
    worker = connector.worker
    handle, wait = worker.handle_preemptions, worker.wait

    def handle_preemptions() -> None:
        keep = choose()
        worker.wait = lambda job_ids: wait([j for j in job_ids if keep(j)])  # type: ignore[method-assign]
        try:
            handle()
        finally:
            worker.wait = wait  # type: ignore[method-assign]

    worker.handle_preemptions = handle_preemptions  # type: ignore[method-assign]


def _skip_not_applied(engine: Engine, connector: Connector) -> None:
    """Admission's skips are recorded and counted, but the store takes every block offered anyway."""
    admission = connector.scheduler.admission
    offer = admission.offer

    def offer_all(record: RequestRecord, start: int, hashes: Sequence[int], held: Container[int],
                  parent: int | None = None) -> Verdict:
        verdict = offer(record, start, hashes, held, parent)
        return Verdict(tuple(hashes), verdict.skipped)

    admission.offer = offer_all  # type: ignore[method-assign]


def _flush_waits_pending_only(engine: Engine, connector: Connector) -> None:
    """The preemption hook waits only for the flushed stores it submits itself, not for those already copying."""
    worker = connector.worker

    def pending() -> Callable[[int], bool]:
        jobs = worker.jobs
        return {j for j in worker._meta.flush
                if j in jobs and jobs[j].state == TransferJobState.PENDING_STORE}.__contains__

    _flush_waits_only_for(connector, pending)


def _flush_skips_failed_stores(engine: Engine, connector: Connector) -> None:
    """The preemption hook does not wait for a flushed store that failed part-way through its pipeline."""
    worker = connector.worker
    _flush_waits_only_for(connector, lambda: lambda j: j not in worker._records.failed)


def _fail_without_end_event(engine: Engine, connector: Connector) -> None:
    """A copy that fails part-way is reported at once, not once the copies it had already enqueued ran."""
    worker = connector.worker
    records = worker._records
    fail = records.fail

    def fail_at_once(job: TransferJob, stream: StreamName, err: Exception) -> None:
        fail(job, stream, err)
        worker.events._ends.pop(job.job_id, None)

    records.fail = fail_at_once  # type: ignore[method-assign]


def _no_load_dedup(engine: Engine, connector: Connector) -> None:
    manager = connector.scheduler.manager
    pin = manager._machine

    def lookup(hashes: Sequence[int], every_busy: bool = True) -> Lookup:
        hits = 0
        for block_hash in hashes:
            slot = manager.catalogue.get(block_hash)
            if slot is None or manager.blocks[slot].state not in (CpuBlockState.READY, CpuBlockState.LOADING):
                break
            hits += 1
        return Lookup(hits, ())

    def prepare_load(hashes: Sequence[int], job_id: int | None = None) -> tuple[int, ...]:
        slots = tuple(manager.catalogue[h] for h in hashes)
        pin.fire_many([manager.blocks[s] for s in slots], "pin", job_id=job_id)
        return slots

    manager.lookup = lookup  # type: ignore[method-assign]
    manager.prepare_load = prepare_load  # type: ignore[method-assign]


def _no_write_after_read_wait(engine: Engine, connector: Connector) -> None:
    connector.worker._wait_for_readers = lambda job: None  # type: ignore[method-assign]


def _no_lazy_fence(engine: Engine, connector: Connector) -> None:
    """The step that hands out a finished or aborted request's block fences it, but flushes none of the stores
    still reading it: the step writes the block under a store still copying it."""
    connector.scheduler.ledger.flush_readers = lambda blocks, step: None  # type: ignore[method-assign]


def _unpinned_load(engine: Engine, connector: Connector) -> None:
    manager = connector.scheduler.manager
    prepare, complete = manager.prepare_load, manager.complete_load

    def prepare_load(hashes: Sequence[int], job_id: int | None = None) -> tuple[int, ...]:
        slots = prepare(hashes, job_id)
        complete(slots)  # readers dropped at once: the block is evictable while the load still reads it
        return slots

    manager.prepare_load = prepare_load  # type: ignore[method-assign]
    manager.complete_load = lambda slots: None  # type: ignore[method-assign]


def _wait_on_wrong_layer(engine: Engine, connector: Connector) -> None:
    worker = connector.worker
    events = worker.events
    events.layer = lambda job_id, segment: events._segments[job_id][0]  # type: ignore[method-assign]


def _store_event_before_write(engine: Engine, connector: Connector) -> None:
    worker, stores = connector.worker, connector.worker._stores
    record, wait = stores._record_layer_written, worker.wait_for_layer_load
    marks: list = []

    def wait_for_layer_load(layer: str) -> None:
        wait(layer)
        marks.append(record())  # recorded before the layer's compute is enqueued

    worker.wait_for_layer_load = wait_for_layer_load  # type: ignore[method-assign]
    stores._record_layer_written = lambda: marks[-1]  # type: ignore[method-assign]


def _partial_load_report(engine: Engine, connector: Connector) -> None:
    worker = connector.worker

    events = worker.events

    def landed(job_id: int, first: int, _seen: set[int]) -> int:
        job, pending = worker.jobs[job_id], events._segments[job_id][first:]
        # the first landed segment taken for all of them
        return job.segments - first if pending and worker.device.query(pending[0]) else 0

    events.landed = landed  # type: ignore[method-assign]


def _flush_first_segment(engine: Engine, connector: Connector) -> None:
    worker = connector.worker

    def wait(job_ids: Sequence[int]) -> None:
        for job_id in job_ids:
            events = worker.events._segments.get(job_id) or [worker.events.end(job_id)]
            if events[0] is not None:
                worker.device.synchronize(events[0])

    worker.wait = wait  # type: ignore[method-assign]


def complete_on_first_report(scheduler: SchedulerConnector) -> None:
    """A job finishes on the first rank's report (later ones are only logged): its slots are published while other
    ranks may still copy into them. A control for tensor parallelism: with one worker it is kvfsm."""

    def first_report(job: TransferJob) -> bool | None:
        return next(iter(job.reports.values())) if len(job.reports) == 1 else None

    scheduler._verdict = first_report  # type: ignore[method-assign]


def publish_on_partial_failure(scheduler: SchedulerConnector) -> None:
    """Once every rank reported, a job succeeds if any rank's copy did: slots holding some heads are published. A
    control for tensor parallelism: with one worker it is kvfsm."""
    workers = scheduler.config.num_workers

    def any_rank_succeeded(job: TransferJob) -> bool | None:
        return any(job.reports.values()) if len(job.reports) == workers else None

    scheduler._verdict = any_rank_succeeded  # type: ignore[method-assign]


def inline_under_async_scheduling(scheduler: SchedulerConnector) -> None:
    """`layer_loads` taken at its word although the engine schedules each step before it read the previous one's
    output: CPU hits are computed in the step that loads them, and a failed load's step is followed by one computed on
    the blocks that did not land. A control for vLLM's async scheduling: under synchronous scheduling it is kvfsm."""
    scheduler.inline_loads = scheduler.config.layer_loads


def bound_per_store(scheduler: SchedulerConnector) -> None:
    """Each store is held to `store_max_blocks_in_flight` alone, as if no other store were in flight: every store
    fits, and together they pile up past the bound on the copy stream."""
    bound = scheduler.store_bound
    bound.room = lambda: bound.bound  # type: ignore[method-assign,assignment,return-value]


def queue_bound_per_batch(scheduler: SchedulerConnector) -> None:
    """Each completed store's blocks are held to the tier's `writeback_max_queued_blocks` alone, not with the blocks
    already queued: a tier that falls behind queues every store's worth, store after store."""
    planner = scheduler.tiers
    assert planner is not None
    planner._queue_room = lambda tier, arriving: min(  # type: ignore[method-assign]
        arriving, planner.queue_bounds.get(tier, arriving))


def _deferral_never_re_examined(engine: Engine, connector: Connector) -> None:
    """A standing deferral answers every later lookup of its request, whether the jobs it waits on ended or not: the
    request waits on nothing, never looked up again."""
    ledger = connector.scheduler.ledger

    def stands(record: RequestRecord, step: int) -> bool:
        if record.req_id not in ledger.deferrals or record.state != RequestState.DEFERRED:
            return False
        record.standing = step
        return True

    ledger.stands = stands  # type: ignore[method-assign]


def _busy_pool_is_miss(engine: Engine, connector: Connector) -> None:
    planner = connector.scheduler.tiers
    assert planner is not None, "busy-pool-is-miss needs a lower tier"
    busy_pool_is_miss(planner)


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("no-compute-barrier", "store-after-compute (vLLM 31341, 46278)", _no_compute_barrier),
        Mutant("no-preemption-flush", "fence (vLLM 29870)", _no_preemption_flush),
        Mutant("flush-waits-pending-only", "fence (vLLM 29870: a store already copying when its request is "
               "preempted still reads the blocks the engine reuses)", _flush_waits_pending_only),
        Mutant("flush-skips-failed-stores", "fence (a flushed store that failed part-way through its chunks still "
               "reads the blocks the engine reuses)", _flush_skips_failed_stores, per_layer=False,
               fails_part_way="store"),
        Mutant("fail-without-end-event", "load-before-use (a load that failed part-way is recomputed while a layer "
               "it had sent still writes the blocks)", _fail_without_end_event, fails_part_way="load"),
        Mutant("skip-not-applied", "skipped-not-stored (blocks offered fewer times than the store threshold "
               "stored while the skipped-store counter says they were not)", _skip_not_applied, store_threshold=2),
        Mutant("no-load-dedup", "single-load (vLLM 29087)", _no_load_dedup),
        Mutant("no-write-after-read-wait", "load-after-readers (vLLM 47282)", _no_write_after_read_wait),
        Mutant("no-lazy-fence", "lazy-fence, fence (a finished or aborted request's block handed out again while "
               "its store still copies it)", _no_lazy_fence),
        Mutant("unpinned-load", "readers-pin (TRT-LLM two writers of one host block)", _unpinned_load),
        Mutant("wait-on-wrong-layer", "layer-load-before-use (every layer waits on layer 0's segment)",
               _wait_on_wrong_layer, per_layer=True, layer_loads=True),
        Mutant("store-event-before-write", "layer-store-after-compute (the store event recorded before the write)",
               _store_event_before_write, per_layer=True, layer_stores=True),
        Mutant("partial-load-report", "load-before-use (a load reported when only its first segment landed)",
               _partial_load_report, per_layer=False, load_lags=True),
        Mutant("flush-first-segment", "layer-stores-flushed (a flush waits for a store's first layer only)",
               _flush_first_segment, per_layer=True, layer_stores=True),
        *(Mutant(name, breaks, apply, tier="disk") for name, breaks, apply in TIER_MUTANTS),
        *(Mutant(name, breaks, apply, tier="mooncake") for name, breaks, apply in MOONCAKE_MUTANTS),
        Mutant("bound-per-store", "stores-bounded (stores in flight past the bound: loads starve behind them)",
               lambda engine, connector: bound_per_store(connector.scheduler), store_bound=1),
        Mutant("queue-bound-per-batch", "writeback-queue-bounded (a saturated tier's queue grows store by store)",
               lambda engine, connector: queue_bound_per_batch(connector.scheduler), tier="disk", queue_bound=1),
        Mutant("deferral-never-re-examined", "standing-deferral (a deferred request kept waiting after the job it "
               "waited on ended: it starves)", _deferral_never_re_examined),
        Mutant("busy-pool-is-miss", "fetch-waits-for-room (a prefix the disk holds recomputed because the CPU pool "
               "was busy for a step)", _busy_pool_is_miss, tier="disk", max_cpu_blocks=2),
    )
}


def _flush_on_rank_0_only(engine: Engine, connector: Connector) -> None:
    for worker in connector.workers[1:]:
        worker.handle_preemptions = lambda: None  # type: ignore[method-assign]


TP_CONTROLS: dict[str, Callable[[SchedulerConnector], None]] = {
    "complete-on-first-report": complete_on_first_report,
    "publish-on-partial-failure": publish_on_partial_failure,
}
"""The tensor-parallel controls of the scheduler half alone: they apply where it runs by itself (rank 0's process
of `python -m kvfsm.tp`)."""

def every_rank_writes(worker: WorkerConnector) -> None:
    """Replicated KV: this rank copies every store into the shared pool, its writer's or not, as a pool per rank
    did: the same bytes cross PCIe once per rank (and two ranks write one slot). A control of a worker half: with
    one worker, or without `replicated`, it is kvfsm."""
    worker._stores.copies = lambda job_id: True


def _every_rank_writes_everywhere(engine: Engine, connector: Connector) -> None:
    for worker in connector.workers:
        every_rank_writes(worker)


TP_WORKER_CONTROLS: dict[str, Callable[[WorkerConnector], None]] = {"every-rank-writes": every_rank_writes}
"""The tensor-parallel controls of a worker half: they apply on every rank (each rank's process of
`python -m kvfsm.tp`)."""

TP_MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        Mutant("complete-on-first-report", "every-rank-reports (a store published with one rank's heads written)",
               lambda engine, connector: complete_on_first_report(connector.scheduler), per_layer=False),
        Mutant("publish-on-partial-failure", "fail-everywhere (a CPU block with one rank's heads missing)",
               lambda engine, connector: publish_on_partial_failure(connector.scheduler), per_layer=False),
        Mutant("flush-on-rank-0-only", "preempt-flushes, fence on rank 1 (a reused block written mid-store)",
               _flush_on_rank_0_only, per_layer=False),
        Mutant("every-rank-writes", "replicated-single-writer (replicated KV copied over PCIe once per rank)",
               _every_rank_writes_everywhere, per_layer=False),
    )
}
"""Controls that differ from kvfsm only with several workers: the tensor-parallel interleavings must catch each."""


def restore_without_state(scheduler: SchedulerConnector) -> None:
    """An engine request's KV-cache groups matched apart: each group's hit is cut at the prefix's end, but the
    prefix's own hit is offered whatever its partners hold there, so a prefix whose state (or window) at its end was
    never stored is loaded alone and the engine resumes from the state its GPU block happens to hold. A control of
    an engine with a state-space group (vLLM's Mamba): with one KV-cache group it is kvfsm."""
    match_together = scheduler.match_together

    def apart(request_id: str, partners: Sequence[str], end_block: int) -> bool:
        for partner in partners:
            match_together(partner, (), end_block)
        return True

    scheduler.match_together = apart  # type: ignore[method-assign]


def idle_with_orders_pending(scheduler: SchedulerConnector) -> None:
    """A step with no request scheduled or preempted is taken for an idle one even when the step before ordered
    stores (or a load, or a flush): they are submitted a step late, or never while no request is scheduled, though
    the workers run them already. A control of the idle step's shortcut (`SchedulerConnector._nothing_to_order`)."""
    scheduler._nothing_to_order = lambda output: not (output.req_ids or output.preempted)  # type: ignore[method-assign]


IDLE_CONTROLS: dict[str, Callable[[SchedulerConnector], None]] = {"idle-with-orders-pending": idle_with_orders_pending}
"""Controls of the idle step: each takes a step that has something to order for an idle one."""
