"""A worker half's stores, from order to copy: when each may read its GPU blocks, and how it goes out.

A store reads GPU blocks the forward pass writes, so it never starts before that write (`store-after-compute`):
it waits on an event recorded after the forward (`after_forward`), is checked and placed meanwhile, and is sent
the next step as one pipeline of chunks (`pieces`). With per-layer stores a layer's share goes out behind an event
recorded right after that layer's write (`layer-store-after-compute`, `save_layer`). The worker decides when each
of these runs in a step; this module is what each does.

With replicated KV (`OffloadConfig.replicated`: the ranks share one host pool) a store is copied by its writer rank
alone (`replicated-single-writer`); on every other rank the job copies nothing and ends behind an event on the
store stream, so it is reported as any store is. The scheduler half still ends it only on every rank's report,
the writer's included, so no rank loads the slot before the writer's copy completed (`every-rank-reports`).

What this worker sent GPU to CPU can be kept per job (`sent`): counted as each copy is enqueued, below the choice of
which stores this rank copies, so a rank that copies another's store shows in it on a device that keeps no access
log (a GPU); `python -m kvfsm.tp --mla` checks it (`replicated-single-writer`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

from kvfsm.connector.metadata import StoreOrder
from kvfsm.connector.turns import Piece
from kvfsm.connector.worker_jobs import WorkerJobs
from kvfsm.executor.device import Device, Event
from kvfsm.executor.transfer import Chunks, Segments, Transfers
from kvfsm.records import TransferJob
from kvfsm.states import TransferJobState


class WorkerStores:
    """One worker's stores between their order and their last copy sent."""

    def __init__(self, records: WorkerJobs, device: Device, transfers: Callable[[], Transfers],
                 copies: Callable[[int], bool] = lambda job_id: True, keep_sent: bool = False) -> None:
        """`transfers`: the worker's transfers, asked for at each use (they exist once its caches are registered);
        `copies`: whether this worker copies the store of a job id (with replicated KV, only its writer does);
        `keep_sent`: keep `sent` (an entry per store job: for checks, not for an engine's lifetime)."""
        self._records = records
        self.copies = copies
        self.sent: dict[int, int] | None = {} if keep_sent else None
        """With `keep_sent`: bytes this worker's store copies enqueued GPU to CPU, by job id."""
        self._device = device
        self._transfers = transfers
        self._planned: dict[int, tuple[Event, Chunks | Exception | None]] = {}
        """Per pending store, the event after the forward that writes it, and its chunks (or why it cannot be
        sent, or None where another rank copies it), planned in `after_forward`."""
        self._layer_stores: dict[int, tuple[Segments, set[int]]] | None = None
        """This step's stores begun by `save_layer`: their segments and which segments went out."""
        self._pending: list[TransferJob] = []

    def submit_pending(self) -> list[TransferJob]:
        """As a step starts: the stores planned last step and still pending (not flushed) go to submitted, returned
        for `pieces`, and `save_layer` starts afresh on this step's stores."""
        stores = [job for job in self._pending if job.state == TransferJobState.PENDING_STORE]
        for job in stores:
            self._records.machine.fire(job, "submit", step=self._records.step())
        self._pending = []
        self._layer_stores = None
        return stores

    def save_layer(self, segment: int, orders: Sequence[StoreOrder]) -> None:
        """Right after the layer of `segment` wrote this step's KV: its share of these stores goes out behind an
        event recorded now (the first layer submits the stores)."""
        if self._layer_stores is None:
            self._layer_stores = {}
            for order in orders:
                job = self._records.new(order, "store")
                self._records.machine.fire(job, "prepare")
                self._records.machine.fire(job, "submit", step=self._records.step())
                if not self.copies(job.job_id):
                    self._records.record_end([job], "store")
                    continue
                try:
                    segments = self._transfers().store_segments(job.gpu_blocks, job.cpu_slots)
                except Exception as err:  # noqa: BLE001 (every transfer failure must end as a failed job)
                    self._records.fail(job, "store", err)
                    continue
                job.segments = self._transfers().num_segments
                self._records.events.segmented(job.job_id)
                self._layer_stores[job.job_id] = (segments, set())
        written = self._record_layer_written()
        for job_id, (segments, saved) in self._layer_stores.items():
            self._store_segment(job_id, segments, saved, segment, written)

    def _record_layer_written(self) -> Event:
        """layer-store-after-compute: the event a layer's store segments wait on, recorded after its write."""
        written = self._device.new_event()
        self._device.record("compute", written)
        return written

    def _store_segment(self, job_id: int, segments: Segments, saved: set[int], segment: int, written: Event) -> None:
        job = self._records.jobs[job_id]
        if segment in saved or job.state == TransferJobState.FAILED:
            return
        saved.add(segment)
        self._device.wait("store", written)
        try:
            segments.enqueue(segment, f"store job {job_id} layer {segment}")
        except Exception as err:  # noqa: BLE001 (every transfer failure must end as a failed job)
            self._records.fail(job, "store", err)
            return
        if self.sent is not None:  # kept for checks only: an engine's store path computes nothing for it
            self._count(self.sent, (job_id,), (segments.nbytes(segment),))
        self._records.events.record_segment("store", (job_id,))

    def after_forward(self, orders: Sequence[StoreOrder]) -> None:
        """After the forward pass: mark where compute ends and queue these stores behind that mark (the layers
        `save_layer` already sent are not sent again)."""
        compute_done = self._device.new_event()
        self._device.record("compute", compute_done)
        if self._layer_stores is not None:
            for job_id, (segments, saved) in self._layer_stores.items():
                for segment in range(self._transfers().num_segments):
                    self._store_segment(job_id, segments, saved, segment, compute_done)
            self._layer_stores = None
            return
        for order in orders:
            job = self._records.new(order, "store")
            self._records.machine.fire(job, "prepare")
            self._planned[job.job_id] = (compute_done, self._plan_store(job) if self.copies(job.job_id) else None)
            self._pending.append(job)

    def _plan_store(self, job: TransferJob) -> Chunks | Exception:
        """Check a store and place its blocks while the forward that writes them still runs, so the step that
        sends it starts copying sooner; what makes it unsendable is kept, to fail it once it is submitted."""
        try:
            return self._transfers().store_chunks(job.gpu_blocks, job.cpu_slots)
        except Exception as err:  # noqa: BLE001 (every transfer failure must end as a failed job)
            return err

    def pieces(self, jobs: Sequence[TransferJob]) -> list[Piece]:
        """Submitted stores, planned in `after_forward`, as one pipeline of chunks (`Chunks`), each job's event
        recorded after its last chunk; a store that could not be planned fails alone, and stores sharing a CPU slot
        (never ordered by the scheduler) get a pipeline each."""
        checked: list[tuple[TransferJob, Chunks]] = []
        for job in jobs:
            compute_done, plan = self._planned.pop(job.job_id)
            self._wait_for_compute(compute_done)
            if plan is None:  # another rank's copy: nothing to send, the job ends here
                self._records.record_end([job], "store")
            elif isinstance(plan, Exception):
                self._records.fail(job, "store", plan)
            else:
                checked.append((job, plan))
        slots = [slot for job, _ in checked for slot in job.cpu_slots]
        groups = [checked] if len(set(slots)) == len(slots) else [[item] for item in checked]
        return [piece for group in groups if group for piece in self._chunk_pieces(group)]

    def _chunk_pieces(self, group: list[tuple[TransferJob, Chunks]]) -> list[Piece]:
        jobs = [job for job, _ in group]
        chunks = self._records.merged(jobs, "store", lambda: self._transfers().merge_chunks([c for _, c in group]))
        if chunks is None:
            return []
        label = self._records.label("store", jobs)
        ending: dict[int, list[TransferJob]] = {}
        for job, end in zip(jobs, chunks.ends):
            ending.setdefault(end, []).append(job)
        broken: list[Exception] = []

        def send(chunk: int) -> None:
            if broken:
                return
            try:
                chunks.enqueue(chunk, f"{label} chunk {chunk}")
            except Exception as err:  # noqa: BLE001 (every transfer failure must end as a failed job)
                broken.append(err)
                for job in jobs:
                    if self._records.events.end(job.job_id) is None:
                        self._records.fail(job, "store", err)
                return
            if self.sent is not None:  # kept for checks only: each chunk's share per job costs O(jobs) to work out
                self._count(self.sent, [job.job_id for job in jobs], chunks.part_bytes(chunk))
            if chunk in ending:
                self._records.record_end(ending[chunk], "store")

        return [(chunks.nbytes(chunk), partial(send, chunk)) for chunk in range(chunks.count)]

    @staticmethod
    def _count(sent: dict[int, int], job_ids: Sequence[int], nbytes: Sequence[int]) -> None:
        """Add what one enqueued copy moved of each of these jobs to `sent`."""
        for job_id, moved in zip(job_ids, nbytes):
            if moved:
                sent[job_id] = sent.get(job_id, 0) + moved

    def _wait_for_compute(self, compute_done: Event) -> None:
        """store-after-compute: the store stream waits on the event recorded after the forward that wrote it."""
        self._device.wait("store", compute_done)
