"""The spec's named invariants about tensor-parallel ranks: every rank reports a job before it ends, one rank's failure
fails the job everywhere, and with replicated (MLA) KV only a store job's writer rank writes its CPU slots.

They read the same `World` as `kvfsm.invariants` (its rank, the number of workers, the jobs' reports, the device
log); they live apart because only engines with more than one rank can break them. `replicated-single-writer` is
also read from the bytes each rank's worker sent (`replicated_single_writer_bytes`), where no device log exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from kvfsm.config import store_writer
from kvfsm.invariants import World
from kvfsm.records import TransferJob
from kvfsm.registry import REGISTRY
from kvfsm.states import TransferJobState as J


@REGISTRY.invariant("every-rank-reports")
def every_rank_reports(world: World) -> list[str]:
    return [
        f"{job.kind} job {job.job_id} is {job.state} with reports from ranks {sorted(job.reports)} "
        f"of {world.num_workers}"
        for job in world.jobs.values()
        if job.state in (J.DONE, J.FAILED) and len(job.reports) != world.num_workers
    ]


@REGISTRY.invariant("fail-everywhere")
def fail_everywhere(world: World) -> list[str]:
    return [
        f"{job.kind} job {job.job_id} is done although ranks {failed} failed it"
        for job in world.jobs.values()
        if job.state == J.DONE and (failed := sorted(rank for rank, ok in job.reports.items() if not ok))
    ]


STORE_JOBS = re.compile(r"^store jobs? ([\d,]+)")
"""The job ids in the device log's label of a store copy ("store job 3 chunk 0", "store jobs 3,4 layer 1"), as the
worker half names them (`kvfsm.connector.worker_jobs.WorkerJobs.label`)."""


@REGISTRY.invariant("replicated-single-writer")
def replicated_single_writer(world: World) -> list[str]:
    if not world.replicated:
        return []
    found = []
    for access in world.accesses:
        named = STORE_JOBS.match(access.label)
        if access.actor != "store" or access.mode != "write" or access.space != "cpu" or named is None:
            continue
        for job_id in map(int, named.group(1).split(",")):
            writer = store_writer(job_id, world.num_workers)
            if writer != world.rank:
                found.append(f"rank {world.rank} wrote CPU slot {access.block} for store job {job_id}, whose writer "
                             f"is rank {writer}")
    return found


def replicated_single_writer_bytes(jobs: Iterable[TransferJob], sent: Sequence[Mapping[int, int]],
                                   slot_bytes: int) -> list[str]:
    """`replicated-single-writer` read from what each rank's worker sent rather than from a device log, so that it
    holds on a GPU too (which keeps no log): `sent[rank]` is that rank's `WorkerConnector.store_bytes`. Every byte a
    rank sent belongs to a store whose writer it is, and every store that ended done crossed from GPU to host
    memory exactly once over all ranks (its slots' bytes, `slot_bytes` each): a second copy is PCIe traffic and
    host writes replicated KV exists to save, a missing one a slot published unwritten."""
    workers = len(sent)
    found = [f"rank {rank} copied {nbytes} bytes of store job {job_id} over PCIe, whose writer is rank {writer}"
             for rank, by_job in enumerate(sent) for job_id, nbytes in sorted(by_job.items())
             if (writer := store_writer(job_id, workers)) != rank]
    for job in jobs:
        if job.kind == "store" and job.state == J.DONE:
            copied, one_copy = sum(by_job.get(job.job_id, 0) for by_job in sent), len(job.cpu_slots) * slot_bytes
            if copied != one_copy:
                found.append(f"store job {job.job_id} crossed PCIe as {copied} bytes over all ranks; one copy is "
                             f"{one_copy}")
    return found
