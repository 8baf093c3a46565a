"""A worker half's transfer jobs: where each one is made from its order, failed at submission, and forgotten.

Both directions of the worker make jobs and fail them (its stores in `stores.py`, its loads in `worker.py`). They
share this one core, so that a failure, whichever side it comes from, goes through the spec's job machine the same
way and always leaves an end event after what the job had already enqueued, for a report, a flush or a later load
into the same GPU blocks to wait on.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, TypeVar

from kvfsm.connector.job_events import JobEvents
from kvfsm.connector.metadata import LoadOrder, StoreOrder
from kvfsm.machines import LifecycleMachine
from kvfsm.records import TransferJob

log = logging.getLogger("kvfsm.connector.worker")
"""The worker half's log, whichever of its modules writes: its failures are logged under one name."""

Merged = TypeVar("Merged")


class WorkerJobs:
    """The jobs one worker was ordered and has not reported yet, and those of them that failed."""

    def __init__(self, machine: LifecycleMachine, events: JobEvents, step: Callable[[], int]) -> None:
        """`step`: the step the worker is in (its bound metadata's), recorded with every change of a job."""
        self.machine = machine
        self.events = events
        self.step = step
        self.jobs: dict[int, TransferJob] = {}
        self.failed: list[int] = []
        """Failed jobs not reported yet, in the order they failed."""

    def new(self, order: StoreOrder | LoadOrder, kind: str) -> TransferJob:
        job = TransferJob(job_id=order.job_id, kind=kind, req_id=order.req_id,  # type: ignore[arg-type]
                          gpu_blocks=order.gpu_blocks, cpu_slots=order.cpu_slots, hashes=(),
                          gpu_offset=getattr(order, "gpu_offset", 0), ordered_step=self.step())
        self.jobs[job.job_id] = job
        return job

    def fail(self, job: TransferJob, stream: Any, err: Exception) -> None:
        """A failure at submission fails the job visibly, never wedged, and the engine recomputes: whatever raised
        (a refused job, a CUDA error, a host allocation that failed, a bug). Copies enqueued before the failure
        may still run, so an event is recorded after them: the failure is reported, and later loads into the same
        GPU blocks wait, only once they ran."""
        log.warning("%s job %d failed at submission: %s: %s", job.kind, job.job_id, type(err).__name__, err)
        self.machine.fire(job, "fail", step=self.step())
        self.failed.append(job.job_id)
        self.record_end([job], stream)

    def merged(self, jobs: Sequence[TransferJob], stream: Any, merge: Callable[[], Merged]) -> Merged | None:
        """Jobs sent together as one transfer (a step's stores as one pipeline, its loads a layer at a time): what
        `merge` makes of their checked copies, or None once every one of them failed, as a lone job would, where
        it raised."""
        try:
            return merge()
        except Exception as err:  # noqa: BLE001 (every transfer failure must end as a failed job)
            for job in jobs:
                self.fail(job, stream, err)
            return None

    @staticmethod
    def label(kind: str, jobs: Sequence[TransferJob]) -> str:
        """How the device's log names jobs sent together: "store jobs 3,4", "load job 5"."""
        return f"{kind} job{'s' if len(jobs) > 1 else ''} {','.join(str(job.job_id) for job in jobs)}"

    def record_end(self, jobs: Sequence[TransferJob], stream: Any) -> None:
        """One event after what these jobs enqueued so far, their end. Where the device cannot record it, the jobs
        fail and keep the end they had: the event after the last segment they sent, or none if they sent none."""
        try:
            self.events.record_end(stream, [job.job_id for job in jobs])
        except Exception as err:  # noqa: BLE001 (a device that cannot record leaves no newer event to wait for)
            for job in jobs:
                log.warning("%s job %d: no end event could be recorded: %s", job.kind, job.job_id, err)
                if job.job_id not in self.failed:
                    self.machine.fire(job, "fail", step=self.step())
                    self.failed.append(job.job_id)

    def drop(self, job_id: int) -> None:
        """Forget a reported job and its events."""
        del self.jobs[job_id]
        self.events.drop(job_id)
