"""Tensor-parallel ranks of the reference engine: each holds its heads' KV on its own device, with its worker half.

Engines shard attention by heads: rank r of n holds heads [r·h/n, (r+1)·h/n) of every layer, writes and reads only
their KV, and an all-reduce sums the ranks' shares before a token is picked. Each rank has a connector worker half
of its own, so its pinned pool holds its own heads' bytes, and the one scheduler half hears from every rank.

The engine's scheduler hands every rank the same `StepPlan` (pydantic, so it crosses to rank processes as JSON).
A rank runs it in vLLM's order: bind the orders and wait for the stores a preemption flushed (before this rank's
compute writes any of its blocks), poison, start loads, the forward pass with the all-reduce, queue stores, report.
`LocalRanks` runs every rank in this process; `kvfsm.engine.distributed` runs one rank per process.

With replicated KV (`replicated=True`, MLA) every rank holds every head's KV in MLA-shaped caches, one
(blocks, block_size, latent) tensor per layer registered with layout "mla", and computes its share of the heads
from it; the model sees each cache through a (2, blocks, block_size, heads, dim) view of the same bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from kvfsm.connector.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.connector.worker import WorkerConnector
from kvfsm.engine.forward import Forward
from kvfsm.engine.model import ModelShape, ToyModel
from kvfsm.engine.requests import EngineRequest, Work
from kvfsm.executor.device import Device
from kvfsm.executor.sim import SimDevice


class HeadsDoNotDivide(ValueError):
    """The model's attention heads cannot be split evenly among the ranks."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RankWork(_Message):
    """One request's part of a step's forward pass: KV for positions [start, end), then maybe a sample."""

    handle: int
    """The engine's id for the request, unique for the run (request ids may be reused)."""
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    blocks: tuple[int, ...]
    start: int
    end: int
    sample: bool


class StepPlan(_Message):
    """One engine step, the same for every rank."""

    step: int
    metadata: ConnectorMetadata | None = None
    """The connector's orders (None without offloading)."""
    poison: tuple[int, ...] = ()
    """GPU blocks that left the engine's pool: overwritten so that a stray read shows in the output."""
    work: tuple[RankWork, ...] = ()
    compute_delay_cycles: int = 0

    @classmethod
    def of(cls, step: int, metadata: ConnectorMetadata | None, poison: Sequence[int], work: Sequence[Work],
           compute_delay_cycles: int) -> StepPlan:
        """The plan of an engine step that computes `work` (the engine's own requests)."""
        return cls(step=step, metadata=metadata, poison=tuple(poison), compute_delay_cycles=compute_delay_cycles,
                   work=tuple(RankWork(handle=w.request.handle, request_id=w.request.request_id,
                                       prompt=w.request.prompt, max_new_tokens=w.request.max_new_tokens,
                                       blocks=w.blocks, start=w.start, end=w.end, sample=w.sample) for w in work))


class Rank:
    """One rank: its heads' KV caches on its device, its share of the model, the tokens it sampled, its worker."""

    def __init__(self, shape: ModelShape, num_gpu_blocks: int, device: Device, index: int = 0, world: int = 1,
                 worker: WorkerConnector | None = None, replicated: bool = False) -> None:
        if shape.num_heads % world:
            raise HeadsDoNotDivide(f"{shape.num_heads} heads do not divide among {world} ranks")
        per_rank = shape.num_heads // world
        self.index = index
        self.device = device
        self.worker = worker
        self.heads = range(index * per_rank, (index + 1) * per_rank)
        """The heads whose share of the sum this rank computes (and, unless replicated, the only KV it holds)."""
        self.held = range(shape.num_heads) if replicated else self.heads
        """The heads whose KV this rank holds: every head with replicated KV."""
        self.layout = "mla" if replicated else "kv-first"
        device_kind = device.tensor_device()
        if replicated:
            self._raw = [torch.zeros(num_gpu_blocks, shape.block_size, 2 * shape.num_heads * shape.head_dim,
                                     dtype=shape.dtype, device=device_kind) for _ in range(shape.num_layers)]
            self.caches = [raw.view(num_gpu_blocks, shape.block_size, 2, shape.num_heads, shape.head_dim)
                           .permute(2, 0, 1, 3, 4) for raw in self._raw]
        else:
            self.caches = [torch.zeros(2, num_gpu_blocks, shape.block_size, per_rank, shape.head_dim,
                                       dtype=shape.dtype, device=device_kind) for _ in range(shape.num_layers)]
            self._raw = self.caches
        self.model = ToyModel(shape, self.caches, self.held, self.heads)
        self.layer_names = [f"layer.{i}" for i in range(shape.num_layers)]
        self.forward = Forward(device, self.model, self.caches, self.layer_names, shape.block_size)
        self._block_size = shape.block_size
        self._requests: dict[int, EngineRequest] = {}
        """This rank's view of each request, by handle: its prompt and the tokens this rank sampled."""
        self._work: tuple[int, list[Work]] = (-1, [])

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        """The tensors to register, in `self.layout`."""
        return dict(zip(self.layer_names, self._raw))

    @property
    def handles(self) -> list[int]:
        """Every request this rank computed for, by the engine's handle."""
        return list(self._requests)

    def sampled(self, handle: int) -> list[torch.Tensor]:
        request = self._requests.get(handle)
        return request.sampled if request is not None else []

    # --- a step, phase by phase ------------------------------------------------------------------------------

    def flush(self, plan: StepPlan) -> None:
        """Bind the step's orders and wait for this rank's copies of the stores a preemption flushed."""
        if self.worker is not None and plan.metadata is not None:
            self.worker.bind_connector_metadata(plan.metadata)
            self.worker.handle_preemptions()

    def compute(self, plan: StepPlan) -> torch.Tensor | None:
        """Poison, start this step's loads, enqueue the forward pass; its shares of the sampled sums (or None)."""
        self.forward.poison(list(plan.poison), plan.step)
        if self.worker is not None and plan.metadata is not None:
            self.worker.start_load_kv()
        return self.forward.partial_sums(self._works(plan), plan.step, plan.compute_delay_cycles)

    def sample(self, plan: StepPlan, summed: Callable[[], torch.Tensor]) -> None:
        self.forward.sample(self._works(plan), plan.step, summed)

    def finish(self, plan: StepPlan) -> WorkerOutput | None:
        """Queue this step's stores behind the forward pass; this rank's finished jobs."""
        if self.worker is None:
            return None
        if plan.metadata is not None:
            self.worker.wait_for_save()
        return self.worker.get_finished()

    def _works(self, plan: StepPlan) -> list[Work]:
        if self._work[0] != plan.step:
            self._work = (plan.step, [Work(self._request(w), w.blocks, w.start, w.end, w.sample) for w in plan.work])
        return self._work[1]

    def _request(self, w: RankWork) -> EngineRequest:
        request = self._requests.get(w.handle)
        if request is None:
            request = self._requests[w.handle] = EngineRequest(w.request_id, w.prompt, w.max_new_tokens,
                                                               self._block_size, handle=w.handle)
        return request


class RankGroup(ABC):
    """Every rank of a tensor-parallel engine, driven a step at a time by the engine's scheduler."""

    @property
    @abstractmethod
    def leader(self) -> Rank:
        """Rank 0, in this process: its device and its tokens are the engine's."""

    @property
    @abstractmethod
    def local(self) -> Sequence[Rank]:
        """The ranks in this process, rank 0 first."""

    @abstractmethod
    def run_step(self, plan: StepPlan) -> tuple[WorkerOutput, ...]:
        """Run `plan` on every rank; every rank's worker output, by rank (none without a connector)."""


class LocalRanks(RankGroup):
    """Every rank in this process, each on its own `SimDevice` (the ranks of one GPU engine run one process each:
    `kvfsm.engine.distributed`). The all-reduce is, on each rank's compute stream, a wait for every other rank's
    forward pass, then a sum; the devices are made each other's peers, and every rank's streams still interleave by
    its own schedule."""

    def __init__(self, shape: ModelShape, num_gpu_blocks: int, devices: Sequence[Device],
                 workers: Sequence[WorkerConnector | None], replicated: bool = False) -> None:
        world = len(devices)
        self.ranks = [Rank(shape, num_gpu_blocks, device, index, world, worker, replicated)
                      for index, (device, worker) in enumerate(zip(devices, workers, strict=True))]
        sims = [d for d in devices if isinstance(d, SimDevice)]
        for sim in sims:
            sim.peers = [other for other in sims if other is not sim]

    @property
    def leader(self) -> Rank:
        return self.ranks[0]

    @property
    def local(self) -> Sequence[Rank]:
        return self.ranks

    def run_step(self, plan: StepPlan) -> tuple[WorkerOutput, ...]:
        for rank in self.ranks:
            rank.flush(plan)
        partials = [rank.compute(plan) for rank in self.ranks]
        if any(p is not None for p in partials):
            self._wait_for_every_forward()

            def summed() -> torch.Tensor:
                return torch.stack([p for p in partials if p is not None]).sum(dim=0)

            for rank in self.ranks:
                rank.sample(plan, summed)
        return tuple(output for rank in self.ranks if (output := rank.finish(plan)) is not None)

    def _wait_for_every_forward(self) -> None:
        """Each rank's compute stream waits for every other rank's forward pass, as a collective does."""
        forwards = []
        for rank in self.ranks:
            event = rank.device.new_event()
            rank.device.record("compute", event)
            forwards.append(event)
        for rank in self.ranks:
            for other, event in zip(self.ranks, forwards):
                if other is not rank:
                    rank.device.wait("compute", event)
