"""Completions from several ranks: a job ends once every rank reported it, and fails everywhere if any rank failed.

A tensor-parallel engine shards each block's KV by attention heads, so one transfer job is one copy per rank, each
of that rank's heads. A CPU block holds the whole block only when every rank's copy finished; one failed copy
leaves it holding some ranks' heads and stale bytes for the others. The scheduler half therefore finishes a job
only when all `num_workers` ranks reported it (spec: `every-rank-reports`) and fails it if any of them failed it
(spec: `fail-everywhere`). A report it cannot place is refused, with the whole output, before anything is applied
(`kvfsm.connector.validation.check_reports`: `UnknownWorker`, `UnknownJob` for a job never given, already
finished, or reported twice by one rank).
"""

from __future__ import annotations

from typing import Mapping

from kvfsm.connector.metadata import ConnectorOutput
from kvfsm.records import TransferJob


def rank_reports(output: ConnectorOutput, jobs: Mapping[int, TransferJob]) -> list[tuple[int, TransferJob, bool]]:
    """(rank, job, ok) for every report of an output `validation.check_reports` accepted, in delivery order, each
    job looked up before any of them finishes."""
    return [(worker.worker, jobs[job_id], ok) for worker in output.workers
            for job_id, ok in [*((j, True) for j in worker.done), *((j, False) for j in worker.failed)]]


def every_rank_verdict(job: TransferJob, num_workers: int) -> bool | None:
    """None while some rank has not reported the job; then whether every rank succeeded."""
    if len(job.reports) < num_workers:
        return None
    return all(job.reports.values())
