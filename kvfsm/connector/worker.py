"""The connector's worker half: executes the scheduler's orders on a device, in the order the spec demands.

Each order becomes a transfer job that moves through the spec's job lifecycle on this worker too (made and failed
in `worker_jobs.py`, for both directions). The ordering rules live in the worker half and nowhere else: here, which
hook sends what and what a load waits on; in `stores.py`, what a store waits on and how it goes out:
- a store waits on the compute event recorded after the forward pass that wrote its blocks, and is submitted at
  the start of the next step (`start_load_kv`), after that step's sampled tokens were copied out; it is checked
  and placed as that forward ends (`wait_for_save`), so the step that sends it only sends it;
- a load waits for everything already enqueued on the compute stream and for every store still reading its
  destination blocks (write-after-read);
- `handle_preemptions` submits and waits for every flushed store before the engine reuses its GPU blocks;
- a load is reported by `get_finished` only once its event is done, so compute never reads it early.

Per-layer path (optional: an engine that never calls these hooks gets the behaviour above). A step's loads go out
together as one segment per layer, in layer order, each followed by its own event, and land segment by segment; a
load completes once every segment landed (on a one-segment cache each load goes out alone, behind its own event).
`wait_for_layer_load(layer)` makes the compute stream wait on that layer's segment of this step's loads, so an
engine that computes in the step that loads overlaps its forward with the load.
`save_kv_layer(layer)` (with `OffloadConfig.layer_stores`) starts that layer's share of this step's stores behind
an event recorded right after the layer's write, instead of after the whole forward; `wait_for_save` sends the
layers the engine did not save. Such a store is reported from the next step on, once the scheduler has moved it
to submitted.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Sequence

import torch

from kvfsm.bindings import default_spec
from kvfsm.config import OffloadConfig, moves_tier_jobs, store_writer
from kvfsm.connector.checksums import SlotChecksums
from kvfsm.connector.job_events import JobEvents
from kvfsm.connector.metadata import ConnectorMetadata, LoadOrder, WorkerOutput
from kvfsm.connector.refusals import NotRegistered, StoreBytesNotKept
from kvfsm.connector.stores import WorkerStores
from kvfsm.connector.tier_runner import TierRunner
from kvfsm.connector.turns import Piece, send_in_turns
from kvfsm.connector.validation import (
    check_halves,
    check_metadata,
    check_registered_caches,
    check_registration,
)
from kvfsm.connector.worker_jobs import WorkerJobs
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import KVCaches, register_kv_caches
from kvfsm.executor.pool import HostPool
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.executor.transfer import Segments, Transfers
from kvfsm.machines import MachineSet
from kvfsm.records import TransferJob
from kvfsm.states import TransferJobState
from kvfsm.tiers.base import LowerTier, TierSite
from kvfsm.tiers.factory import IoFactory, open_tiers

class SharedHostMissing(ValueError):
    """Replicated KV over several ranks, but no host memory shared by them: each rank would pin a copy of its own."""


_RUNNING = frozenset({TransferJobState.SUBMITTED, TransferJobState.FLUSHED_ON_PREEMPT})
"""A job's states while its copies are on a stream: the ones whose end event `get_finished` polls."""


class WorkerConnector:
    def __init__(self, config: OffloadConfig, device: Device, worker: int = 0,
                 machines: MachineSet | None = None, tier_io: IoFactory | None = None,
                 keep_lookups: bool = False, shared_host: SharedHostMemory | None = None,
                 keep_store_bytes: bool = False) -> None:
        """`shared_host`: with `config.replicated` and several ranks, the host memory this host's ranks share (one
        `SharedHostMemory` per process, attached to the region the first rank created); `keep_store_bytes`: count
        what each store job's copies moved (`store_bytes`)."""
        check_halves("WorkerConnector", config, device, worker)
        if config.replicated and config.num_workers > 1 and shared_host is None:
            raise SharedHostMissing(f"worker {worker}: replicated KV over {config.num_workers} ranks needs the "
                                    "host memory the ranks share (shared_host)")
        self.config = config
        self.device = device
        self.worker = worker
        self._machines = machines or MachineSet(default_spec())
        self._job = self._machines["transfer-job"]
        self._meta = ConnectorMetadata(step=0)
        self.events = JobEvents(device)
        self._records = WorkerJobs(self._job, self.events, lambda: self._meta.step)
        self._stores = WorkerStores(self._records, device, lambda: self.transfers,
                                    lambda job_id: not config.replicated
                                    or store_writer(job_id, config.num_workers) == worker, keep_store_bytes)
        self._shared_host = shared_host
        self._step_loads: list[int] = []
        self._load_batch: list[tuple[TransferJob, Segments]] = []
        """This step's checked loads, sent together by `_load_pieces` once every order of the step was seen."""
        self._caches: KVCaches | None = None
        self._pool: HostPool | None = None
        self._transfers: Transfers | None = None
        self._checksums: SlotChecksums | None = None
        self._tiers: TierRunner | None = None
        self._tier_io = tier_io
        self._keep_lookups = keep_lookups

    # --- set-up ----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], layout: str,
                           groups: dict[str, list[str]] | None = None) -> KVCaches:
        """Validate the engine's caches, pin a host pool of exactly the configured size for them and open the lower
        tiers. All or nothing: if any step after the pin fails (a tier that cannot open), the pool is unpinned
        before the error propagates and nothing is kept, so a retry pins one pool, not a second beside a leaked
        first that `shutdown` no longer knows of."""
        check_registration(self, kv_caches)
        caches = register_kv_caches(kv_caches, layout, groups)
        check_registered_caches(self.config, caches)
        k = self.config.block_size_factor
        with ExitStack() as undo:
            pool = undo.enter_context(HostPool(self.device, self.config.num_cpu_blocks(caches.gpu_block_bytes),
                                               k * caches.gpu_block_bytes, self._shared_host))
            transfers = Transfers(self.device, caches, pool, block_size_factor=k, mechanism=self.config.mechanism,
                                  staging_bytes=self.config.staging_bytes)
            checksums = SlotChecksums(pool, self._shared_host) if self.config.checksum else None
            tiers = None
            if self.config.lower_tiers:  # `open_tiers` closes the tiers it opened if a later one fails
                site = TierSite(self.config, pool.slot_bytes, self.worker, caches, pool)
                moves = moves_tier_jobs(self.config, self.worker)  # with replicated KV, one rank opens the tiers
                opened = open_tiers(site, self._tier_io, self._keep_lookups, self._machines) if moves else ()
                tiers = TierRunner(opened, pool, checksums, [tier.tier_name for tier in self.config.lower_tiers],
                                   lambda job_id: moves)
            undo.pop_all()  # registered: the pool now lives until `shutdown`
        self._pool, self._transfers, self._tiers, self._checksums = pool, transfers, tiers, checksums
        self._caches = caches
        return caches

    @property
    def jobs(self) -> dict[int, TransferJob]:
        """The jobs this worker was ordered and has not reported yet, by id."""
        return self._records.jobs

    @property
    def transfers(self) -> Transfers:
        if self._transfers is None:
            raise NotRegistered("register_kv_caches must run before any transfer")
        return self._transfers

    @property
    def pool(self) -> HostPool:
        if self._pool is None:
            raise NotRegistered("register_kv_caches must run before the host pool exists")
        return self._pool

    @property
    def store_bytes(self) -> dict[int, int]:
        """Bytes this worker's store copies moved GPU to CPU (over PCIe on a GPU), by job id, counted as each copy is
        enqueued: a job another rank copies has none here. Kept with `keep_store_bytes` only (an entry per job)."""
        if self._stores.sent is None:
            raise StoreBytesNotKept(f"worker {self.worker}: store_bytes is kept only by a worker built with "
                                    "keep_store_bytes=True")
        return self._stores.sent

    @property
    def lower_tiers(self) -> tuple[LowerTier, ...]:
        """The lower tiers this worker opened, in lookup order (the scheduler half of one process looks them up)."""
        return tuple(self._tiers.tiers.values()) if self._tiers is not None else ()

    def shutdown(self) -> None:
        """Wait for every transfer in flight, close the lower tiers, then unpin and free the host pool."""
        self.wait(self.events.jobs())
        if self._tiers is not None:
            self._tiers.close()
        if self._pool is not None:
            self._pool.close()

    # --- one engine step ---------------------------------------------------------------------------------

    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        check_metadata(self, meta)
        self._meta = meta

    def handle_preemptions(self) -> None:
        """Before the engine writes any reused GPU block: submit the flushed stores still pending, wait for all,
        failed ones too: a store that failed part-way through its pipeline still has chunks reading the blocks."""
        flushed = [self.jobs[j] for j in self._meta.flush if j in self.jobs and self.jobs[j].in_flight]
        pending = []
        for job in flushed:
            if job.state == TransferJobState.PENDING_STORE:
                pending.append(job)
            self._job.fire(job, "flush")
        send_in_turns(self._stores.pieces(pending))
        self.wait([job.job_id for job in flushed])

    def start_load_kv(self) -> None:
        """Hand this step's write-backs and fetches to the lower tiers, then send the stores prepared last step and
        this step's loads, in turns (`send_in_turns`); a load into a GPU block one of these stores reads is sent
        only after every store, since it must wait on that store's event."""
        if self._tiers is not None:
            self._tiers.submit(self._meta.tier_orders)
        stores = self._stores.submit_pending()
        self._step_loads = []
        store_pieces = self._stores.pieces(stores)
        read = {block for job in stores for block in job.gpu_blocks}
        if any(read.intersection(order.gpu_blocks) for order in self._meta.loads):
            send_in_turns(store_pieces)
            store_pieces = []
        for order in self._meta.loads:
            self._submit_load(order)
        send_in_turns(store_pieces, self._load_pieces())

    def wait_for_layer_load(self, layer: str) -> None:
        """Before `layer` reads KV: the compute stream waits on that layer's segment of this step's loads only.
        Without inline loads (`layer_loads` off, or an engine that schedules ahead) nothing this step computes reads
        them (loads are asynchronous), so nothing waits."""
        segment = self.transfers.segment_of(layer)  # an unknown layer is an error whatever the configuration
        if not self.config.inline_loads:
            return
        waited: set[int] = set()
        for job_id in self._step_loads:
            event = self.events.layer(job_id, segment)
            if event is not None and id(event) not in waited:  # loads sent together share their segment events
                waited.add(id(event))
                self.device.wait("compute", event)

    def save_kv_layer(self, layer: str) -> None:
        """Right after `layer` wrote this step's KV: with `layer_stores`, that layer's share of this step's stores
        goes out behind an event recorded now; otherwise stores wait for the end of the forward as usual."""
        segment = self.transfers.segment_of(layer)  # an unknown layer is an error whatever the configuration
        if not self.config.layer_stores or not self._meta.stores:
            return
        self._stores.save_layer(segment, self._meta.stores)

    def wait_for_save(self) -> None:
        """After the forward pass: mark where compute ends and queue this step's stores behind that mark (the
        layers `save_kv_layer` already sent are not sent again)."""
        if not self._meta.stores:
            return
        _ = self.transfers  # NotRegistered before any job exists, not a job stuck in pending-store
        self._stores.after_forward(self._meta.stores)

    def get_finished(self) -> WorkerOutput:
        """Jobs whose copies completed (or failed) since the last call, each reported once."""
        done = []
        landed: set[int] = set()
        for job in self.jobs.values():
            if job.state not in _RUNNING:
                continue
            if self._ordered_this_step(job):
                continue
            if job.segments:
                self._job.fire_many([job] * self.events.landed(job.job_id, job.landed_segments, landed),
                                    "land-segment")
                finished = job.landed_segments == job.segments
            else:
                finished = self.events.ended(job.job_id)
            if finished:
                self._job.fire(job, "complete", step=self._meta.step)
                done.append(job.job_id)
                if self._checksums is not None and job.kind == "store" and self._stores.copies(job.job_id):
                    self._checksums.record(job.cpu_slots)  # replicated: the writer alone, once its copy landed
        failed = [j for j in self._records.failed if not self._ordered_this_step(self.jobs[j])
                  and (self.events.end(j) is None or self.events.ended(j))]
        self._records.failed = [j for j in self._records.failed if j not in failed]
        for job_id in (*done, *failed):
            self._records.drop(job_id)
        tiers = self._tiers.poll() if self._tiers is not None else ()
        return WorkerOutput(worker=self.worker, done=tuple(done), failed=tuple(failed), tiers=tiers)

    def _ordered_this_step(self, job: TransferJob) -> bool:
        """A per-layer store of this very step: the scheduler moves it to submitted only as the next step starts,
        so it is reported (done or failed) from then on."""
        return job.kind == "store" and job.ordered_step == self._meta.step

    def wait(self, job_ids: Sequence[int]) -> None:
        """Block until these jobs' copies are done (they are still reported by `get_finished`)."""
        self.events.wait(job_ids)

    # --- the loads' ordering rules -------------------------------------------------------------------------

    def _submit_load(self, order: LoadOrder) -> None:
        """Check one load and queue it for this step's `_load_pieces`; a load that cannot be sent fails alone."""
        _ = self.transfers  # NotRegistered before the job exists, not a job stuck in submitted
        job = self._records.new(order, "load")
        self._job.fire(job, "submit", step=self._meta.step)
        self._wait_for_readers(job)
        self.events.segmented(job.job_id)
        self._step_loads.append(job.job_id)
        try:
            if self._checksums is not None:
                self._checksums.verify(job.cpu_slots)
            segments = self.transfers.load_segments(job.cpu_slots, job.gpu_blocks, job.gpu_offset)
        except Exception as err:  # noqa: BLE001 (every transfer failure must end as a failed job)
            self._records.fail(job, "load", err)
            return
        self._load_batch.append((job, segments))

    def _load_pieces(self) -> list[Piece]:
        """This step's loads go out together: one segment per layer, in layer order, each followed by one event
        that every job of the batch lands that segment on. Sending each job's layers separately cost a
        submission per job and layer (on the H100, host submission of 4 jobs x 32 layers took longer than their
        copies). Where a job is one segment (a cross-layer cache) there is nothing to share, so each job goes out
        alone, behind its own event: an engine hears of the first load while the step's later loads still copy.
        Loads whose GPU blocks overlap (never ordered by the scheduler) also go out one job at a time, in order.
        A load sent whole (`Segments.whole`: fragmented CPU slots) goes out alone after the others, so the rest
        still land a layer at a time."""
        batch, self._load_batch = self._load_batch, []
        blocks = [block for job, _ in batch for block in job.gpu_blocks]
        if len(batch) < 2 or self.transfers.num_segments == 1 or len(set(blocks)) != len(blocks):
            groups = [[item] for item in batch]
        else:
            groups = [[item for item in batch if not item[1].whole]] + [[item] for item in batch if item[1].whole]
        return [piece for group in groups if group
                for piece in self._segment_pieces([job for job, _ in group], [segments for _, segments in group])]

    def _segment_pieces(self, jobs: list[TransferJob], parts: list[Segments]) -> list[Piece]:
        segments = self._records.merged(jobs, "load", lambda: self.transfers.merge(parts))
        if segments is None:
            return []
        label = self._records.label("load", jobs)
        count = self.transfers.num_segments
        for job in jobs:
            job.segments = count
        broken: list[Exception] = []

        def send(segment: int) -> None:
            if broken:
                return
            try:
                segments.enqueue(segment, f"{label} layer {segment}")
                self.events.record_segment("load", [job.job_id for job in jobs])
            except Exception as err:  # noqa: BLE001 (every transfer failure must end as a failed job)
                broken.append(err)
                for job in jobs:
                    self._records.fail(job, "load", err)

        return [(segments.nbytes(segment), partial(send, segment)) for segment in range(count)]

    def _wait_for_readers(self, job: TransferJob) -> None:
        """load-after-readers: wait for all compute enqueued so far and for stores still reading the blocks."""
        barrier = self.device.new_event()
        self.device.record("compute", barrier)
        self.device.wait("load", barrier)
        targets = set(job.gpu_blocks)
        for other in self.jobs.values():
            end = self.events.end(other.job_id) if other.kind == "store" else None
            if end is not None and targets.intersection(other.gpu_blocks):
                self.device.wait("load", end)
