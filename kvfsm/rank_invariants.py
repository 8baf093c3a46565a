"""The spec's named invariants about tensor-parallel ranks: every rank reports a job before it ends, one rank's failure
fails the job everywhere, and with replicated (MLA) KV only a store job's writer rank writes its CPU slots.

They read the same `World` as `kvfsm.invariants` (its rank, the number of workers, the jobs' reports, the device
log); they live apart because only engines with more than one rank can break them.
"""

from __future__ import annotations

import re

from kvfsm.config import store_writer
from kvfsm.invariants import World
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
