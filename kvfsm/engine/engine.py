"""A deliberately small inference engine that drives `kvfsm.Connector` the way a vLLM-style engine does.

Real where it matters for offloading: continuous batching over a paged GPU KV cache with prefix caching;
preemption when blocks run out (freed blocks are reallocated at once); async scheduling (the host enqueues step
N+1 while step N's GPU work may still be pending — nothing here waits for compute); a model that writes KV on the
compute stream and whose tokens depend on the bytes actually in the cache. The connector is called at vLLM's
points: lookup, after-allocation, metadata, preemption hook before reused blocks are written, start of step,
after forward, finished transfers, request finished. Without a connector it is the no-offloading baseline.

With `per_layer`, the forward runs layer by layer on the compute stream and calls the connector's per-layer hooks
(`wait_for_layer_load` before a layer reads KV, `save_kv_layer` after it wrote); when the connector says a load is
not asynchronous (its `layer_loads`), a request with a CPU hit is computed in the very step its load goes out, each
layer behind that layer's segment of the load. Until the load is
reported it computes nothing more, is neither preempted nor finished; a failed load rolls back that step's sample
and recomputes from the first block that did not land, and an abort meanwhile drops that sample (the aborted
request never hears whether its load landed).

With tensor parallelism (several devices, or a `RankGroup`) this engine is the one scheduler and its device work runs
on the ranks of `kvfsm.engine.ranks`, whole forwards only.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Sequence

import torch

from kvfsm.connector import Connector, SchedulerConnector
from kvfsm.connector.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    ScheduledRequest,
    SchedulerOutput,
    WorkerOutput,
)
from kvfsm.engine.blocks import BlockPool
from kvfsm.engine.config import EngineConfig, LayerByLayerOnOneDevice, RequestIdInUse
from kvfsm.engine.forward import Forward
from kvfsm.engine.model import ToyModel
from kvfsm.engine.ranks import LocalRanks, RankGroup, StepPlan
from kvfsm.engine.requests import EngineRequest, Phase, Work
from kvfsm.executor.device import Device


class _Admission(enum.Enum):
    ADMITTED = "admitted"
    DEFERRED = "deferred"
    STOP = "stop"


class Engine:
    """`device`: one device; one per tensor-parallel rank (a `Connector` with as many workers); or a `RankGroup`,
    whose ranks bring their own worker halves (then `connector` is the scheduler half alone)."""

    def __init__(self, config: EngineConfig, device: Device | Sequence[Device] | RankGroup,
                 connector: Connector | SchedulerConnector | None = None) -> None:
        self.config = config
        shape = config.model
        if connector is not None:
            if connector.config.layer_loads and not config.per_layer:
                raise ValueError("a connector with layer_loads needs an engine that calls the per-layer hooks")
            if connector.config.gpu_block_size != shape.block_size:
                raise ValueError(f"the connector pages {connector.config.gpu_block_size}-token blocks, "
                                 f"the engine {shape.block_size}-token blocks")
        self.layer_names = [f"layer.{i}" for i in range(shape.num_layers)]
        self.ranks: RankGroup | None = None
        """The tensor-parallel ranks; None for one device, whose work this engine enqueues itself."""
        if isinstance(device, (RankGroup, Sequence)):
            if config.per_layer:
                raise LayerByLayerOnOneDevice("a tensor-parallel engine computes whole forwards (per_layer=False)")
            self.ranks = device if isinstance(device, RankGroup) else self._local_ranks(list(device), connector)
            leader = self.ranks.leader
            self.device, self.caches, self.model = leader.device, leader.caches, leader.model
        else:
            self.device = device
            self.caches = [
                torch.zeros(2, config.num_gpu_blocks, shape.block_size, shape.num_heads, shape.head_dim,
                            dtype=shape.dtype, device=device.tensor_device())
                for _ in range(shape.num_layers)
            ]
            self.model = ToyModel(shape, self.caches)
            self.forward = Forward(self.device, self.model, self.caches, self.layer_names, shape.block_size)
        self.pool = BlockPool(config.num_gpu_blocks)
        self.connector = connector
        if isinstance(connector, Connector) and self.ranks is None:
            connector.register_kv_caches(dict(zip(self.layer_names, self.caches)), "kv-first")
        self.step_count = 0
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.loading: dict[str, EngineRequest] = {}
        self.held: dict[str, EngineRequest] = {}
        self.live: dict[str, EngineRequest] = {}
        self.finished: list[EngineRequest] = []
        self._next_handle = 0
        self.compute_delay_cycles = config.compute_delay_cycles
        """Settable between steps: tests delay the compute stream to widen race windows on the GPU."""
        self._reports: deque[tuple[WorkerOutput, ...]] = deque()
        self._forced: dict[str, bool] = {}
        """Requests to preempt at the next step, each with whether its blocks are reclaimed at once."""
        self.preemptions = 0
        self.computed_tokens = 0
        self.gpu_hit_tokens = 0
        self.cpu_hit_tokens = 0

    def _local_ranks(self, devices: list[Device], connector: Connector | SchedulerConnector | None) -> LocalRanks:
        """Ranks in this process, each registering its caches with its own worker half of `connector`."""
        if isinstance(connector, SchedulerConnector):
            raise TypeError("ranks in this process need both connector halves (a Connector), not the scheduler half")
        workers = connector.workers if connector is not None else [None] * len(devices)
        replicated = connector is not None and connector.config.replicated
        ranks = LocalRanks(self.config.model, self.config.num_gpu_blocks, devices, workers, replicated)
        if connector is not None:
            for rank in ranks.local:
                connector.register_kv_caches(rank.kv_caches, rank.layout, rank=rank.index)
        return ranks

    # --- requests ----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue a request; returns a handle for its output (request ids may be reused once one is done)."""
        if request_id in self.live:
            raise RequestIdInUse(f"request id {request_id!r} is still in the engine")
        if self.connector is not None and self.connector.tracks(request_id):
            raise RequestIdInUse(f"request id {request_id!r} ended, but the stores of that request are in flight")
        request = EngineRequest(request_id, tuple(prompt), max_new_tokens, self.config.model.block_size,
                                handle=self._next_handle)
        self._next_handle += 1
        self.live[request_id] = request
        self.waiting.append(request)
        return request.handle

    def abort(self, request_id: str) -> None:
        request = self.live.get(request_id)
        if request is None or request.phase in (Phase.HELD, Phase.DONE):
            return
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        if self.loading.pop(request_id, None) is not None and request.phase is Phase.RUNNING:
            self._drop_last_sample(request)  # computed on an inline load whose outcome it will never hear
        self._finish(request, aborted=True)

    def preempt(self, request_id: str, reclaim: bool = False) -> None:
        """Preempt a running request at the next step (tests and demos force it). With `reclaim`, as memory pressure
        would: its blocks leave the prefix cache and are the next ones handed out, as if another request took them;
        without, they stay cached and the request may resume from them."""
        request = self.live.get(request_id)
        if request is not None and request.phase is Phase.RUNNING and request_id not in self.loading:
            self._forced[request_id] = reclaim

    def reset_prefix_cache(self) -> None:
        """Drop the GPU prefix cache (blocks in use stay): a returning prefix must then come from CPU or compute."""
        self.pool.reset_prefix_cache()

    @property
    def has_work(self) -> bool:
        conn = self.connector
        busy_below = conn is not None and (conn.moving_between_tiers or conn.stores_of_ended_requests)
        return bool(self.waiting or self.running or self.loading or self.held or busy_below)

    # --- one step ------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Schedule and enqueue one step; never waits for the GPU except where kvfsm's fence requires it."""
        self.step_count += 1
        work, preempted = self._schedule()
        conn = self.connector
        meta = None
        if conn is not None:
            scheduled = tuple(
                ScheduledRequest(req_id=w.request.request_id, block_ids=w.blocks, num_computed_tokens=w.end)
                for w in work
            )
            meta = conn.build_connector_meta(SchedulerOutput(scheduled=scheduled, preempted=tuple(preempted)))
        if self.ranks is not None:
            reports = self.ranks.run_step(StepPlan.of(self.step_count, meta, self.pool.take_poison(), work,
                                                      self.compute_delay_cycles))
        else:
            reports = self._run_here(meta, work)
        if conn is not None:
            result = conn.update_connector_output(ConnectorOutput(workers=self._delivered(reports)))
            self._after_transfers(result.loaded, result.released, result.load_errors)
        for w in work:
            if w.sample and w.request.finished and w.request in self.running:
                self.running.remove(w.request)
                if w.request.request_id not in self.loading:  # else it finishes once its load is reported
                    self._finish(w.request, aborted=False)

    def _run_here(self, meta: ConnectorMetadata | None, work: list[Work]) -> tuple[WorkerOutput, ...]:
        """One device's work for the step, enqueued here; its worker's report (none without a connector)."""
        worker = self.connector.worker if isinstance(self.connector, Connector) else None
        if worker is not None and meta is not None:
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions()
        self.forward.poison(self.pool.take_poison(), self.step_count)
        if worker is not None:
            worker.start_load_kv()
        if work and self.config.per_layer:
            self.forward.layers(work, self.step_count, self.compute_delay_cycles, worker)
        elif work:
            self.forward.whole(work, self.step_count, self.compute_delay_cycles)
        if worker is None:
            return ()
        worker.wait_for_save()
        return (worker.get_finished(),)

    def _delivered(self, reports: tuple[WorkerOutput, ...]) -> tuple[WorkerOutput, ...]:
        """The worker reports the connector hears of this step: this step's, or an earlier one's under
        `report_lag`."""
        self._reports.append(reports)
        if len(self._reports) > self.config.report_lag:
            return self._reports.popleft()
        return tuple(WorkerOutput(worker=report.worker) for report in reports)

    def _schedule(self) -> tuple[list[Work], list[str]]:
        budget = self.config.max_batched_tokens
        work: list[Work] = []
        preempted: list[str] = []
        for request in [r for r in self.running if r.request_id in self._forced]:
            if self._forced[request.request_id]:
                self.pool.evict(request.blocks)
            self._preempt(request)
            preempted.append(request.request_id)
        self._forced.clear()
        for request in list(self.running):  # running first: decode (or finish a prefill after a load)
            if request not in self.running or request.request_id in self.loading:
                continue  # preempted below to make room for an earlier one, or its inline load is unreported
            need = -(-request.num_tokens // self.config.model.block_size) - len(request.blocks)
            while need > 0 and (fresh := self.pool.allocate(need)) is None:
                victim = self._victim()
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request not in self.running or (need > 0 and fresh is None):
                continue
            if need > 0:
                request.blocks.extend(fresh)  # type: ignore[arg-type]
            count = request.num_tokens - request.num_computed
            budget -= count
            work.append(self._compute(request, request.num_computed, request.num_tokens))
        for request in list(self.waiting) if not preempted else []:
            if self._admit(request, budget, work) is _Admission.STOP:
                break
            budget = self.config.max_batched_tokens - sum(w.end - w.start for w in work)
        return work, preempted

    def _victim(self) -> EngineRequest | None:
        """The running request preempted first: the latest, skipping any whose inline load is unreported."""
        candidates = [r for r in self.running if r.request_id not in self.loading]
        return candidates[-1] if candidates else None

    def _admit(self, request: EngineRequest, budget: int, work: list[Work]) -> _Admission:
        """Try to schedule a waiting request in queue order; STOP keeps later ones waiting behind it (FCFS)."""
        block_size = self.config.model.block_size
        if request.num_tokens > budget:
            return _Admission.STOP
        computable = (request.num_tokens - 1) // block_size
        hits = self.pool.cached_prefix(request.block_hashes[:computable])
        num_computed = len(hits) * block_size
        external = 0
        if self.connector is not None:
            match = self.connector.get_num_new_matched_tokens(request, num_computed)
            if match is None:  # deferred: someone else is loading its blocks; later requests may go first
                return _Admission.DEFERRED
            external = match[0]
        need = -(-request.num_tokens // block_size) - len(hits)
        self.pool.acquire(hits)
        fresh = self.pool.allocate(need)
        if fresh is None:
            self.pool.release(hits)
            return _Admission.STOP
        self.waiting.remove(request)
        request.blocks = hits + fresh
        request.num_computed = num_computed
        self.gpu_hit_tokens += num_computed
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, request.blocks, external)
        if external:
            request.num_computed = num_computed + external
            self.cpu_hit_tokens += external
            self.loading[request.request_id] = request
            if match is not None and match[1]:  # asynchronous: computed once the load is reported
                request.phase = Phase.LOADING
                return _Admission.ADMITTED
            num_computed += external
        request.phase = Phase.RUNNING
        self.running.append(request)
        work.append(self._compute(request, num_computed, request.num_tokens))
        return _Admission.ADMITTED

    def _compute(self, request: EngineRequest, start: int, end: int) -> Work:
        """Schedule KV for [start, end) and a sample; the full prompt blocks it computes become prefix-cache hits
        (blocks before `start` are hits already, or loaded ones, cached once their load is reported)."""
        self.computed_tokens += end - start
        block_size = self.config.model.block_size
        for index in range(start // block_size, min(end, len(request.prompt)) // block_size):
            self.pool.cache(request.blocks[index], request.block_hashes[index])
        request.num_computed = end
        request.num_sampled += 1
        return Work(request, tuple(request.blocks), start, end, sample=True)

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self.pool.release(request.blocks, rewrite=True)
        request.blocks, request.num_computed, request.phase = [], 0, Phase.WAITING
        self.waiting.appendleft(request)
        self.preemptions += 1

    def _finish(self, request: EngineRequest, aborted: bool) -> None:
        hold = self.connector is not None and self.connector.request_finished(request.request_id, aborted=aborted)
        if hold:
            request.phase = Phase.HELD
            self.held[request.request_id] = request
        else:
            self._release(request)

    def _release(self, request: EngineRequest) -> None:
        self.pool.release(request.blocks)
        request.blocks, request.phase = [], Phase.DONE
        del self.live[request.request_id]
        self.finished.append(request)

    def _after_transfers(self, loaded: set[str], released: set[str], errors: dict[str, tuple[int, ...]]) -> None:
        block_size = self.config.model.block_size
        for req_id in sorted(loaded):  # sets of strings iterate in a per-process order: keep runs repeatable
            request = self.loading.pop(req_id, None)
            if request is None:
                continue  # aborted while loading: it is held until released
            bad = errors.get(req_id, ())
            if request.phase is Phase.RUNNING:  # computed in its load step (per-layer)
                self._inline_load_reported(request, bad)
                continue
            if bad:
                request.num_computed = min(request.blocks.index(b) for b in bad) * block_size
            for index in range(request.num_computed // block_size):
                self.pool.cache(request.blocks[index], request.block_hashes[index])
            request.phase = Phase.RUNNING
            self.running.append(request)
        for req_id in sorted(released):
            request = self.held.pop(req_id, None)
            if request is not None:
                self._release(request)

    def _inline_load_reported(self, request: EngineRequest, bad: tuple[int, ...]) -> None:
        """A per-layer load reported after its step computed on it: cache what landed; if some blocks did not,
        drop that step's sample and recompute from the first of them."""
        block_size = self.config.model.block_size
        landed = min(request.blocks.index(b) for b in bad) if bad else (request.num_computed // block_size)
        for index in range(min(landed, len(request.prompt) // block_size)):
            self.pool.cache(request.blocks[index], request.block_hashes[index])
        if bad:
            self._drop_last_sample(request)
            request.num_computed = landed * block_size
        if request.finished:  # its last sample was this load's step (the load may land within that step)
            if request in self.running:
                self.running.remove(request)
            self._finish(request, aborted=False)
        elif request not in self.running:
            self.running.append(request)

    @staticmethod
    def _drop_last_sample(request: EngineRequest) -> None:
        """Take back the sample of an inline load's step: it read KV that did not land, or that an aborted request
        never hears landed (the connector releases an aborted request without a load outcome). vLLM likewise
        delivers nothing of a step in flight to a request aborted meanwhile."""
        request.sampled.pop()
        request.num_sampled -= 1

    # --- results -------------------------------------------------------------------------------------------

    def outputs(self) -> dict[int, list[int]]:
        """Every finished request's sampled tokens by handle (call once the device has run everything)."""
        return {r.handle: [int(t) for t in self._sampled(r)[: r.max_new_tokens]] for r in self.finished}

    def _sampled(self, request: EngineRequest) -> list[torch.Tensor]:
        """A request's tokens: sampled by this engine's forward, or (tensor parallel) by rank 0."""
        return request.sampled if self.ranks is None else self.ranks.leader.sampled(request.handle)
