"""The models the connector's lifecycles move (cpu-block, transfer-job, request, gpu-block), and the guards and
effects `spec/` names for them; the lower tiers' records are in `kvfsm.tier_records`.

A record's `state` is a state name from the spec and changes only through `kvfsm.machines`; the counters beside
it (readers, store readers) change only through the effects bound here, so a count and its state never disagree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from kvfsm.registry import REGISTRY
from kvfsm.states import CpuBlockState, GpuBlockState, RequestState
from kvfsm.states import TransferJobState as J

JobKind = Literal["store", "load"]
IN_FLIGHT_JOB_STATES = frozenset({J.CREATED, J.PENDING_STORE, J.SUBMITTED, J.FLUSHED_ON_PREEMPT})
FLUSHABLE_JOB_STATES = frozenset({J.PENDING_STORE, J.SUBMITTED})


@dataclass(slots=True, eq=False)
class CpuBlock:
    """A slot of the pinned host pool."""

    slot: int
    state: str = CpuBlockState.FREE
    readers: int = 0
    block_hash: int | None = None
    writer_job: int | None = None
    reader_job: int | None = None
    """The load reading it while it is loading: whom a lookup that meets it waits for."""


@dataclass(slots=True, eq=False)
class TransferJob:
    """One store or load: which request, which GPU blocks, which CPU slots, which prefix hashes."""

    job_id: int
    kind: JobKind
    req_id: str
    gpu_blocks: tuple[int, ...]
    cpu_slots: tuple[int, ...]
    hashes: tuple[int, ...]
    gpu_offset: int = 0
    ordered_step: int = 0
    state: str = J.CREATED
    submit_step: int | None = None
    finished_step: int | None = None
    submitted_at: float = 0.0
    """`time.perf_counter()` when it was submitted: how long it spent in flight is a statistic operators want."""
    segments: int = 0
    """Layer segments the worker moves this job in (0: the scheduler's view, which tracks no segments)."""
    landed_segments: int = 0
    reports: dict[int, bool] = field(default_factory=dict)
    """The scheduler's log of which ranks reported the job and whether it succeeded there (empty on a worker)."""
    inline: bool = False
    """A load the engine computes on in the step that loads it (`loading-inline`), not once it is reported."""
    due_output: int | None = None
    """The engine output that must report this load (`inline-load-in-step`): set for a load computed in its own
    step when the engine reads load errors only in that step's output; None where a later report is fine."""
    reported_output: int | None = None
    """The engine output (counted from 1, one per step) whose reports ended the job, on the scheduler."""

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT_JOB_STATES


@dataclass(slots=True, eq=False)
class RequestRecord:
    """A request as the connector tracks it; `jobs` holds its transfer jobs still in flight.

    Beside the lifecycle state it keeps what the scheduler plans with: the engine's view of it, its GPU blocks and
    how many CPU blocks were ordered stored. When its next CPU block completes is kept beside the records, in
    `Ledger.due`, so a step compares every request with it in C.
    """

    req_id: str
    state: str = RequestState.NEW
    jobs: dict[int, TransferJob] = field(default_factory=dict)
    failed_blocks: tuple[int, ...] = ()
    """GPU blocks whose load failed, set by `mark-load-error`; the engine recomputes them."""
    view: Any = None
    block_ids: Sequence[int] = ()
    stored_cpu_blocks: int = 0
    match: tuple[int, int] | None = None
    """(first GPU block, GPU blocks offered) by the last lookup, until the engine allocates."""
    prompt_cpu_blocks: int = 0
    """Whole CPU blocks of the tokens the request held at its first lookup: what `prompt-only` admission stores."""
    offered_cpu_blocks: int = 0
    """Leading CPU blocks offered to admission so far; unlike `stored_cpu_blocks` it survives a preemption, so a
    resumed request does not offer them again."""
    skipped: dict[int, str] = field(default_factory=dict)
    """CPU-block hashes admission skipped for this request, with the reason (`record-skipped-blocks`)."""
    store_from: int = 0
    """The first GPU block a store of it may read: a sliding-window request's window at the end of its prompt (the
    blocks before it are never reloaded, so never stored)."""
    slid: set[int] = field(default_factory=set)
    """GPU blocks its sliding window left behind while it ran (`record-slid-blocks`): the engine has them back."""
    slid_now: tuple[int, ...] = ()
    """The blocks its last `slide` left behind: what that slide frees (`slid-store-blocks`)."""
    state_of: str | None = None
    """The request whose prefix this one's blocks are the state of (a state-space KV-cache group's, each block the
    state after its last token, tracked beside its prefix): restored only with that prefix, at its end
    (`state-at-prefix-end`). None for any other request."""
    restored: tuple[int, int, int] = (0, 0, 0)
    """(step, first GPU block, end) of what its last allocation loaded; first == end when it loaded nothing."""
    standing: int | None = None
    """The step whose lookup its standing deferral last answered without a lookup (`standing-deferral`); None since
    its last real lookup if none did."""

    @property
    def jobs_in_flight(self) -> list[TransferJob]:
        return [job for job in self.jobs.values() if job.in_flight]


@dataclass(slots=True, eq=False)
class GpuBlock:
    """The connector's fence on one engine-owned GPU block."""

    block_id: int
    state: str = GpuBlockState.WRITABLE
    store_readers: int = 0


# cpu-block -------------------------------------------------------------------------------------------------


# A pool's slots move in batches (a job's slots, a lookup's hits): their effects are written over the batch.


@REGISTRY.effect("cpu-block", "claim-hash", batch=True)
def _claim_hash(blocks: Sequence[CpuBlock], block_hash: int | None = None, job_id: int | None = None,
                hashes: dict[int, int] | None = None, **_: object) -> None:
    """The hash a store writes: `block_hash` for one block, or `hashes[slot]` when a batch is allocated at once."""
    for block in blocks:
        block.block_hash = hashes[block.slot] if hashes is not None else block_hash
        block.writer_job = job_id


@REGISTRY.effect("cpu-block", "forget-hash", batch=True)
def _forget_hash(blocks: Sequence[CpuBlock], **_: object) -> None:
    for block in blocks:
        block.block_hash = None


@REGISTRY.effect("cpu-block", "add-reader", batch=True)
def _add_reader(blocks: Sequence[CpuBlock], job_id: int | None = None, **_: object) -> None:
    for block in blocks:
        block.readers += 1
        block.reader_job = job_id


@REGISTRY.effect("cpu-block", "drop-reader", batch=True)
def _drop_reader(blocks: Sequence[CpuBlock], **_: object) -> None:
    for block in blocks:
        block.readers -= 1


# transfer-job ----------------------------------------------------------------------------------------------


@REGISTRY.guard("transfer-job", "is-store")
def _is_store(job: TransferJob, **_: object) -> bool:
    return job.kind == "store"


@REGISTRY.guard("transfer-job", "is-load")
def _is_load(job: TransferJob, **_: object) -> bool:
    return job.kind == "load"


@REGISTRY.guard("transfer-job", "has-segments-in-flight")
def _has_segments_in_flight(job: TransferJob, **_: object) -> bool:
    return job.landed_segments < job.segments


@REGISTRY.guard("transfer-job", "all-segments-landed")
def _all_segments_landed(job: TransferJob, **_: object) -> bool:
    return job.landed_segments == job.segments


@REGISTRY.effect("transfer-job", "count-landed-segment")
def _count_landed_segment(job: TransferJob, **_: object) -> None:
    job.landed_segments += 1


@REGISTRY.effect("transfer-job", "record-submit-step")
def _record_submit_step(job: TransferJob, step: int | None = None, **_: object) -> None:
    job.submit_step = step
    job.submitted_at = time.perf_counter()


@REGISTRY.effect("transfer-job", "record-finish-step")
def _record_finish_step(job: TransferJob, step: int | None = None, **_: object) -> None:
    job.finished_step = step


# request ---------------------------------------------------------------------------------------------------


@REGISTRY.guard("request", "prefix-busy")
def _prefix_busy(_: RequestRecord, busy: bool = False, **__: object) -> bool:
    return busy


@REGISTRY.guard("request", "prefix-free")
def _prefix_free(_: RequestRecord, busy: bool = False, **__: object) -> bool:
    return not busy


@REGISTRY.guard("request", "has-external-tokens")
def _has_external_tokens(_: RequestRecord, external_tokens: int = 0, **__: object) -> bool:
    return external_tokens > 0


@REGISTRY.guard("request", "no-external-tokens")
def _no_external_tokens(_: RequestRecord, external_tokens: int = 0, **__: object) -> bool:
    return external_tokens == 0


@REGISTRY.guard("request", "inline-load")
def _inline_load(_: RequestRecord, inline: bool = False, **__: object) -> bool:
    """The engine computes the request in the step that loads it (per-layer loads)."""
    return inline


@REGISTRY.guard("request", "async-load")
def _async_load(_: RequestRecord, inline: bool = False, **__: object) -> bool:
    """The engine computes the request only once its load is reported."""
    return not inline


@REGISTRY.guard("request", "has-jobs-in-flight")
def _has_jobs_in_flight(request: RequestRecord, **_: object) -> bool:
    return any(job.state in IN_FLIGHT_JOB_STATES for job in request.jobs.values())


@REGISTRY.guard("request", "no-jobs-in-flight")
def _no_jobs_in_flight(request: RequestRecord, **_: object) -> bool:
    return not any(job.state in IN_FLIGHT_JOB_STATES for job in request.jobs.values())


@REGISTRY.effect("request", "mark-load-error")
def _mark_load_error(request: RequestRecord, cause: TransferJob | None = None, **_: object) -> None:
    """The failed load (the coupling's cause) names the GPU blocks the engine must recompute."""
    request.failed_blocks = cause.gpu_blocks if cause is not None else request.failed_blocks


@REGISTRY.effect("request", "record-skipped-blocks")
def _record_skipped_blocks(request: RequestRecord, hashes: Sequence[int] = (), reason: str = "", **_: object) -> None:
    """The blocks admission skipped stay skipped for this request: none of its stores may carry them."""
    request.skipped.update(dict.fromkeys(hashes, reason))


@REGISTRY.effect("request", "record-slid-blocks")
def _record_slid_blocks(request: RequestRecord, blocks: Sequence[int] = (), **_: object) -> None:
    """The blocks its window left behind this step; the engine has them back (`window-fence` reads the record)."""
    request.slid_now = tuple(blocks)
    request.slid.update(blocks)


@REGISTRY.relation("request", "slid-store-blocks")
def _slid_store_blocks(request: RequestRecord) -> list[int]:
    """The blocks its last slide left behind that its stores in flight read: what the slide leaves freed-while-read
    (a block no store reads is the engine's alone and needs no fence)."""
    read = {b for j in request.jobs.values() if j.kind == "store" and j.in_flight for b in j.gpu_blocks}
    return [b for b in request.slid_now if b in read]


@REGISTRY.relation("request", "flushable-stores")
def _flushable_stores(request: RequestRecord) -> list[int]:
    """Its stores a preemption or abort must submit now and wait for: the pending and the submitted ones."""
    return [j.job_id for j in request.jobs.values() if j.kind == "store" and j.state in FLUSHABLE_JOB_STATES]


@REGISTRY.relation("request", "store-blocks")
def _store_blocks(request: RequestRecord) -> list[int]:
    """The GPU blocks its stores in flight read (each once): what its finish or abort leaves freed-while-read."""
    return list(dict.fromkeys(b for j in request.jobs.values() if j.kind == "store" and j.in_flight
                              for b in j.gpu_blocks))


# couplings of transfer-job ---------------------------------------------------------------------------------


@REGISTRY.relation("transfer-job", "cpu-slots")
def _cpu_slots(job: TransferJob) -> tuple[int, ...]:
    return job.cpu_slots


@REGISTRY.relation("transfer-job", "gpu-blocks")
def _gpu_blocks(job: TransferJob) -> tuple[int, ...]:
    return job.gpu_blocks


@REGISTRY.relation("transfer-job", "owner")
def _owner(job: TransferJob) -> tuple[str, ...]:
    return (job.req_id,)


# gpu-block -------------------------------------------------------------------------------------------------


# A store's GPU fences move in one batch per job: their guards and effects are written over the batch.


@REGISTRY.guard("gpu-block", "has-other-store-readers", batch=True)
def _has_other_store_readers(blocks: Sequence[GpuBlock], **_: object) -> list[bool]:
    return [block.store_readers > 1 for block in blocks]


@REGISTRY.guard("gpu-block", "is-last-store-reader", batch=True)
def _is_last_store_reader(blocks: Sequence[GpuBlock], **_: object) -> list[bool]:
    return [block.store_readers == 1 for block in blocks]


@REGISTRY.effect("gpu-block", "add-store-reader", batch=True)
def _add_store_reader(blocks: Sequence[GpuBlock], **_: object) -> None:
    for block in blocks:
        block.store_readers += 1


@REGISTRY.effect("gpu-block", "drop-store-reader", batch=True)
def _drop_store_reader(blocks: Sequence[GpuBlock], **_: object) -> None:
    for block in blocks:
        block.store_readers -= 1
