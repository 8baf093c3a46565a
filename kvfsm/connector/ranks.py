"""Completions from several ranks: a job ends once every rank reported it, and fails everywhere if any rank failed.

A tensor-parallel engine shards each block's KV by attention heads, so one transfer job is one copy per rank, each
of that rank's heads. A CPU block holds the whole block only when every rank's copy finished; one failed copy
leaves it holding some ranks' heads and stale bytes for the others. The scheduler half therefore finishes a job
only when all `num_workers` ranks reported it (spec: `every-rank-reports`) and fails it if any of them failed it
(spec: `fail-everywhere`). A report it cannot place is refused, with the whole output, before anything is applied
(`kvfsm.connector.validation.check_reports`: `UnknownWorker`, `UnknownJob` for a job never given, already
finished, or reported twice by one rank).

Tier jobs (write-backs, fetches) end the same way: each rank's report is logged on the job (`reports`), and the job
ends once every rank's is in, failing the keys any rank failed and held while any rank's I/O may still run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from kvfsm.connector.metadata import ConnectorOutput
from kvfsm.records import TransferJob
from kvfsm.tier_records import TierJob


class Reported(Protocol):
    """A job as the scheduler logs its ranks' reports."""

    reports: dict[int, Any]


def rank_reports(output: ConnectorOutput, jobs: Mapping[int, TransferJob]) -> list[tuple[int, TransferJob, bool]]:
    """(rank, job, ok) for every report of an output `validation.check_reports` accepted, in delivery order, each
    job looked up before any of them finishes."""
    return [(worker.worker, jobs[job_id], ok) for worker in output.workers
            for job_id, ok in [*((j, True) for j in worker.done), *((j, False) for j in worker.failed)]]


def every_rank(job: Reported, num_workers: int) -> Mapping[int, Any] | None:
    """The job's reports once every rank's is in; None while some rank has not reported it."""
    return job.reports if len(job.reports) >= num_workers else None


def every_rank_verdict(job: TransferJob, num_workers: int) -> bool | None:
    """None while some rank has not reported the job; then whether every rank succeeded."""
    reports = every_rank(job, num_workers)
    return None if reports is None else all(reports.values())


@dataclass(frozen=True, slots=True)
class TierOutcome:
    """A tier job's end over every rank: the keys some rank failed (key: reason), and whether some rank's I/O may
    still touch its CPU slots (it reported the job at its deadline, `held`)."""

    failed: dict[int, str]
    held: bool


def every_rank_tier_outcome(job: TierJob, num_workers: int) -> TierOutcome | None:
    """None while some rank has not reported the tier job; then its outcome over every rank."""
    reports = every_rank(job, num_workers)
    if reports is None:
        return None
    return TierOutcome(failed=dict(pair for report in reports.values() for pair in report.failed),
                       held=any(report.held for report in reports.values()))
