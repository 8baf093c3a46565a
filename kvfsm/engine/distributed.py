"""Tensor parallelism across processes: one process per rank; rank 0 also runs the engine's scheduler and the
connector's scheduler half.

Each step rank 0 broadcasts a `Command` (pydantic JSON: the step plan with the connector's `ConnectorMetadata`) to
every rank; each rank runs it on its own device with its own worker half and pinned pool; rank 0 gathers every
rank's `RankReport` (its `WorkerOutput` and what its own device-log checks found) and the engine hands all the
outputs to `update_connector_output`. Commands travel on a gloo group whatever the backend (they are host objects);
the all-reduce before sampling runs on the default group: NCCL on GPUs, enqueued on the compute stream so that no
host waits for it, or gloo on CPUs.

A gloo all-reduce blocks the host until every rank reaches it, so on `SimDevice` a rank waits for its own compute
stream right after enqueueing the sample (its other streams go on by their own schedule): every process then
reaches the all-reduce at the same point of its program, and none is parked in another collective meanwhile.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from kvfsm.connector.metadata import WorkerOutput
from kvfsm.engine.ranks import Rank, RankGroup, StepPlan
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.executor.sim import SimDevice

Registered = TypeVar("Registered")

AfterStep = Callable[[], list[str]]
"""What a rank does after each step (let its device lag, check its device log): the violations it found."""
PrefixBytes = Callable[[tuple[int, ...], range, str], torch.Tensor]
"""The bytes a rank holding `heads` in caches of a layout must have in the CPU slot that ends a prompt prefix (an
oracle's answer)."""


def register_in_turn(group: dist.ProcessGroup, replicated: bool,
                     register: Callable[[SharedHostMemory | None], Registered]
                     ) -> tuple[Registered, SharedHostMemory | None]:
    """Register this rank's caches, with `replicated` into the host memory the ranks share: rank 0 registers first
    (its pool creates the region), sends the region's path on `group` (gloo; every rank calls this), and the others
    then attach to it and register (one host: every rank is local). Returns what `register` returned, and the
    shared host memory (None without `replicated`)."""
    rank = dist.get_rank()
    shared = SharedHostMemory() if replicated and rank == 0 else None
    registered = register(shared) if rank == 0 else None
    box = [shared.path if shared is not None else None]
    dist.broadcast_object_list(box, src=0, group=group)
    if rank != 0:
        shared = SharedHostMemory(box[0]) if replicated else None
        registered = register(shared)
    return registered, shared  # type: ignore[return-value]


def host_pool_bytes(device: object, shared: SharedHostMemory | None, group: dist.ProcessGroup) -> int:
    """The host memory every rank's pool takes, measured: each rank's own pinned bytes (`Device.host_bytes`) plus
    the bytes of each distinct shared region (counted once, however many ranks map it). Every rank calls this."""
    mine = (getattr(device, "host_bytes", 0), shared.path if shared is not None else None,
            shared.nbytes if shared is not None else 0)
    every: list[tuple[int, str | None, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    ranks = [r for r in every if r is not None]
    return sum(own for own, _, _ in ranks) + sum({path: size for _, path, size in ranks if path}.values())


class RanksOutOfStep(RuntimeError):
    """Rank 0 did not hear from every rank, in rank order: the processes no longer run the same step."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReadySlot(_Message):
    """A CPU slot the scheduler holds ready, and the prompt prefix whose last CPU block it must hold."""

    slot: int
    prefix: tuple[int, ...]


class Command(_Message):
    """What rank 0 broadcasts: a step to run, or slots and tokens to verify, or (neither) the end of the run."""

    plan: StepPlan | None = None
    ready: tuple[ReadySlot, ...] | None = None
    tokens: dict[int, list[int]] | None = None


class RankReport(_Message):
    """One rank's answer: its worker's completions, and what its own checks found wrong."""

    rank: int
    output: WorkerOutput | None = None
    violations: tuple[str, ...] = ()


class Channel:
    """Commands out from rank 0, reports back to it, on a gloo group of every rank."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def command(self, command: Command | None = None) -> Command:
        box = [command.model_dump_json() if command is not None else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return Command.model_validate_json(box[0])  # every rank validates what crossed, rank 0 included

    def report(self, report: RankReport) -> list[RankReport]:
        gathered: list[str | None] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(report.model_dump_json(), gathered, dst=0, group=self.group)
        return [RankReport.model_validate_json(r) for r in gathered or () if r is not None]


def run_plan(rank: Rank, plan: StepPlan, after_step: AfterStep) -> RankReport:
    """One step on this rank: flush, compute its heads, all-reduce and sample, queue stores, report."""
    rank.flush(plan)
    partial = rank.compute(plan)
    if partial is not None:
        def all_reduced() -> torch.Tensor:
            dist.all_reduce(partial)
            return partial

        rank.sample(plan, all_reduced)
        if isinstance(rank.device, SimDevice):
            sampled = rank.device.new_event()
            rank.device.record("compute", sampled)
            rank.device.synchronize(sampled)
    output = rank.finish(plan)
    return RankReport(rank=rank.index, output=output, violations=tuple(after_step()))


def drain(rank: Rank) -> None:
    """Block until everything this rank's device was given has run."""
    if isinstance(rank.device, SimDevice):
        rank.device.run_until_idle()
    else:
        torch.cuda.synchronize()


def verify(rank: Rank, command: Command, expected: PrefixBytes) -> list[str]:
    """This rank's ready CPU slots hold exactly its heads' bytes of their prefixes; its tokens equal rank 0's."""
    drain(rank)
    found = []
    if rank.worker is not None:
        for ready in command.ready or ():
            held = rank.worker.pool.slot(ready.slot).cpu()
            if not torch.equal(held, expected(ready.prefix, rank.held, rank.layout)):
                found.append(f"rank {rank.index}: CPU slot {ready.slot} does not hold its heads' bytes of its prefix")
    for handle, tokens in (command.tokens or {}).items():
        mine = [int(t) for t in rank.sampled(handle)]
        if mine[:len(tokens)] != tokens:
            found.append(f"rank {rank.index}: request {handle} sampled {mine}, rank 0 {tokens}")
    return found


class DistributedRanks(RankGroup):
    """Rank 0's view of the process group: its own rank here, every other rank in a process of its own."""

    def __init__(self, leader: Rank, after_step: AfterStep) -> None:
        self._leader = leader
        self._after_step = after_step
        self.channel = Channel()
        self.violations: list[str] = []
        """What every rank's own checks found, step by step."""

    @property
    def leader(self) -> Rank:
        return self._leader

    @property
    def local(self) -> Sequence[Rank]:
        return [self._leader]

    def run_step(self, plan: StepPlan) -> tuple[WorkerOutput, ...]:
        sent = self.channel.command(Command(plan=plan)).plan
        assert sent is not None
        reports = self.channel.report(run_plan(self._leader, sent, self._after_step))
        if [r.rank for r in reports] != list(range(self.channel.world)):
            raise RanksOutOfStep(f"step {plan.step}: reports from ranks {[r.rank for r in reports]}")
        self.violations += [line for r in reports for line in r.violations]
        return tuple(r.output for r in reports if r.output is not None)

    def verify(self, ready: Sequence[ReadySlot], expected: PrefixBytes) -> list[str]:
        """Every rank checks its pool against its heads' bytes and its tokens against rank 0's."""
        tokens = {handle: [int(t) for t in rank_tokens] for handle, rank_tokens in self._leader_tokens().items()}
        command = self.channel.command(Command(ready=tuple(ready), tokens=tokens))
        mine = RankReport(rank=0, violations=tuple(verify(self._leader, command, expected)))
        return [line for r in self.channel.report(mine) for line in r.violations]

    def _leader_tokens(self) -> dict[int, list[torch.Tensor]]:
        drain(self._leader)
        return {handle: self._leader.sampled(handle) for handle in self._leader.handles}

    def stop(self) -> None:
        self.channel.command(Command())


def follow(rank: Rank, after_step: AfterStep, expected: PrefixBytes) -> Channel:
    """A rank other than 0: run what rank 0 commands until it says the run is over; returns the channel, for what
    the ranks do together next."""
    channel = Channel()
    while True:
        command = channel.command()
        if command.plan is not None:
            channel.report(run_plan(rank, command.plan, after_step))
        elif command.ready is not None:
            channel.report(RankReport(rank=rank.index, violations=tuple(verify(rank, command, expected))))
        else:
            return channel
