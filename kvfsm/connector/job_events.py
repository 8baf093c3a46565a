"""Where a worker's jobs end on the device: the events it reports from and waits on.

Every job that enqueued anything gets an end event after the last of it (its last copy, or whatever ran before it
failed): `get_finished` reports the job once that event is done, a later load into the same GPU blocks waits on it
(write-after-read), and a flush or a shutdown waits on it. A job sent a segment at a time (per-layer loads and
stores) also gets an event after each segment. A job's segments go out on one stream, so they land in the order
they were enqueued: once its newest segment event is done, every earlier one is.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from kvfsm.executor.device import Device, Event, StreamName


class JobEvents:
    """Each job's end event, and each segmented job's segment events in the order they were enqueued."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._ends: dict[int, Event] = {}
        self._segments: dict[int, list[Event]] = {}

    def record_end(self, stream: StreamName, job_ids: Iterable[int]) -> None:
        """One event after what `stream` holds now, the end of these jobs (loads sent together share one)."""
        event = self._record(stream)
        for job_id in job_ids:
            self._ends[job_id] = event

    def segmented(self, job_id: int) -> None:
        """The job goes out a segment at a time: its segment events are kept from now on."""
        self._segments[job_id] = []

    def record_segment(self, stream: StreamName, job_ids: Sequence[int]) -> None:
        """One event after the segment just enqueued on `stream`, for each of these jobs (sent together), and
        their end so far: should the job fail and its own end event then fail to record, what it sent is still
        waited for."""
        event = self._record(stream)
        for job_id in job_ids:
            self._segments[job_id].append(event)
            self._ends[job_id] = event

    def _record(self, stream: StreamName) -> Event:
        event = self.device.new_event()
        self.device.record(stream, event)
        return event

    def end(self, job_id: int) -> Event | None:
        """The job's end event; None if it enqueued nothing (it failed before its first copy)."""
        return self._ends.get(job_id)

    def ended(self, job_id: int) -> bool:
        """Whether everything the job enqueued ran (it must have an end event)."""
        return self.device.query(self._ends[job_id])

    def layer(self, job_id: int, segment: int) -> Event | None:
        """The event after `segment` of a segmented job; for one that failed before sending it, the job's end."""
        events = self._segments[job_id]
        return events[segment] if segment < len(events) else self._ends.get(job_id)

    def landed(self, job_id: int, first: int, seen: set[int]) -> int:
        """How many of the job's segments from `first` on have landed. The newest is asked first, so a job whose
        copies all ended costs one query, not one per layer (32 a job, each a driver call, on a Llama-3-8B
        kv-first cache). `seen`: ids of the events this report already found done (a step's loads share one event
        per segment, so each is asked once, not once per job).

        Found not done, the newest is not asked again: the walk from the oldest stops before it. The copies keep
        running meanwhile, so asked again it may have landed, after every earlier one, and a walk over all of them
        would find none not done (it raised StopIteration out of `get_finished`); the next report counts it."""
        events = self._segments[job_id][first:]
        if not events or self._done(events[-1], seen):
            return len(events)
        return next((i for i, event in enumerate(events[:-1]) if not self._done(event, seen)), len(events) - 1)

    def _done(self, event: Event, seen: set[int]) -> bool:
        if id(event) in seen:
            return True
        if not self.device.query(event):
            return False
        seen.add(id(event))
        return True

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block the host until these jobs' copies ran (a job that enqueued nothing has nothing to wait for)."""
        for job_id in job_ids:
            event = self._ends.get(job_id)
            if event is not None:
                self.device.synchronize(event)

    def jobs(self) -> list[int]:
        """The jobs with an end event still kept."""
        return list(self._ends)

    def drop(self, job_id: int) -> None:
        """Forget a reported job's events."""
        self._ends.pop(job_id, None)
        self._segments.pop(job_id, None)
