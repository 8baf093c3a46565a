"""`python -m kvfsm.tp`: the demo workload served with tensor parallelism, one process per rank.

Rank 0 runs the engine's scheduler and kvfsm's scheduler half; every rank holds its share of the attention heads on
its own device, with its own worker half and pinned pool (`kvfsm.engine.distributed`): gloo and `SimDevice`s on a
CPU, NCCL and one GPU per rank with `--device cuda`. The run fails (exit code 1) unless the spec's invariants held
after every step (the scheduler's on rank 0, the device-log ones on every rank's device), the tokens equal the
single-process run's without offloading, every rank sampled the same tokens, and every ready CPU slot of every rank
holds exactly that rank's heads' bytes of its prefix. `--failing-rank` makes one rank's copies fail now and then
(kvfsm must fail those jobs on every rank and recompute); `--skewed-rank` makes one rank's reports reach the
scheduler `--skew-steps` steps late (kvfsm must end each job only on its last rank's report); `--control` serves with
a tensor-parallel control instead of kvfsm's scheduler half, to see the checks catch it. On two GPUs every rank's
copies end in the step that queued them, so the ranks report each job together and only a skew (or a failing rank)
tells a scheduler half that ends a job on its first report from kvfsm's. `--mla` serves replicated KV: every rank
holds every head's KV in MLA-shaped caches, the ranks share one host pool in `/dev/shm`, each store is copied by
one rank and every rank loads from the shared slot; the run then also fails unless the host pool bytes of all
ranks together are exactly one copy, and unless each store crossed PCIe once, from its writer rank: each rank's
worker counts the bytes its store copies sent, by job, and rank 0 checks them (`replicated-single-writer`, which on
`SimDevice` also reads every rank's device log; a GPU keeps none). `--disk DIR` (with `--mla`) adds a disk tier
below the shared pool: rank 0 alone opens it, writes each block back from the shared pool and fetches it into the
shared pool, the other ranks reporting each tier job having moved nothing (`replicated-one-tier-move`); `--checksum`
checks every rank's loads against the checksums the ranks share.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from kvfsm.checking import DEVICE_LOG_INVARIANTS, DeviceLogWorld
from kvfsm.config import OffloadConfig
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.connector.worker import WorkerConnector
from kvfsm.demo import (CUDA_SHAPE, REFUSALS, SIM_SHAPE, DemoConfig, DemoConfigError, DeviceKind, OneStepBehind,
                        engine_config_for, offload_config, resolve_device, run_once, serve_arrivals)
from kvfsm.demo.switches import TP_CONTROLS, TP_WORKER_CONTROLS, EveryNthFails, LateReports
from kvfsm.engine.distributed import DistributedRanks, ReadySlot, follow, host_pool_bytes, register_in_turn
from kvfsm.engine.engine import Engine
from kvfsm.engine.oracle import BlockOracle, poisoned
from kvfsm.engine.model import ModelShape
from kvfsm.engine.ranks import Rank
from kvfsm.engine.world import EngineWorld
from kvfsm.executor.cuda import CudaDevice
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import KVCaches
from kvfsm.executor.shared_host import SharedHostMemory
from kvfsm.executor.sim import SimDevice
from kvfsm.invariants import check_all
from kvfsm.rank_invariants import replicated_single_writer_bytes
from kvfsm.states import CpuBlockState, TransferJobState
from kvfsm.workload import WorkloadShape, generate

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""A rank that waits longer than this in a collective fails the run instead of hanging it."""
FAILING_EVERY = 3
"""With `--failing-rank`, that rank's every third store or load fails while the other ranks' copies succeed."""
SKEW_STEPS = 2
"""With `--skewed-rank`, that rank's reports reach the scheduler this many steps late unless `--skew-steps` says."""


class Breaks(NamedTuple):
    """What the run breaks on purpose, to watch the checks catch it (`control`) or kvfsm ride it out (the rest)."""

    control: str | None = None
    """One of `TP_CONTROLS` (serving instead of kvfsm's scheduler half) or `TP_WORKER_CONTROLS` (instead of every
    rank's worker half)."""
    failing_rank: int | None = None
    """This rank's every `FAILING_EVERY`-th store or load fails."""
    skewed_rank: int | None = None
    """This rank's reports reach the scheduler `skew_steps` steps late."""
    skew_steps: int = SKEW_STEPS
    mla: bool = False
    """Replicated KV (MLA-shaped caches) with one host copy shared by the ranks: not a break, a mode."""
    checksum: bool = False
    """Block checksums (`OffloadConfig.checksum`): a mode too."""


class TpRun(BaseModel):
    """What rank 0 reports back to the launching process."""

    ranks: int
    device: str
    steps: int
    wall_s: float
    outputs: dict[int, list[int]]
    violations: list[str]
    cpu_hit_tokens: int
    blocks_stored: int
    blocks_loaded: int
    loads_failed: int
    stores_failed: int
    host_pool_bytes: int
    """Host pool bytes of every rank together, measured: each rank's own pinned pool, and a shared region once."""
    one_copy_bytes: int
    """Bytes of one copy of the pool (slots x slot bytes): what `--mla` must use in all."""
    store_pcie_bytes: int | None = None
    """With `--mla`: bytes the stores that ended done sent GPU to host, all ranks together, as each rank's worker
    counted them (`WorkerConnector.store_bytes`); None where not counted."""
    store_one_copy_bytes: int | None = None
    """With `--mla`: bytes of one copy of those stores (their CPU slots): what the ranks must have sent in all."""
    blocks_written_back: int = 0
    blocks_fetched: int = 0
    """Blocks the lower tiers (`--disk`) took and gave back."""


def _device(kind: DeviceKind, index: int, seed: int) -> Device:
    if kind is DeviceKind.cuda:
        torch.cuda.set_device(index)
        return CudaDevice(index)
    return SimDevice(random.Random(seed * 1000 + index).choice)  # each rank its own schedule


def _rank_main(index: int, world: int, rendezvous: str, kind: DeviceKind, config: DemoConfig, breaks: Breaks,
               result: str) -> None:
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only spin (see kvfsm.demo.runs)
    backend = "nccl" if kind is DeviceKind.cuda else "gloo"
    dist.init_process_group(backend, init_method=rendezvous, rank=index, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        _serve_rank(index, world, kind, config, breaks, Path(result))
    finally:
        dist.destroy_process_group()


def _serve_rank(index: int, world: int, kind: DeviceKind, config: DemoConfig, breaks: Breaks, result: Path) -> None:
    shape = SIM_SHAPE if kind is DeviceKind.cpu else CUDA_SHAPE
    arrivals = generate(config.workload, shape.vocab, config.seed)
    engine_config = engine_config_for(arrivals, config.gpu_blocks, shape)
    device = _device(kind, index, config.seed)
    offload = OffloadConfig(cpu_blocks=config.cpu_blocks, block_size_factor=config.block_size_factor,
                            gpu_block_size=shape.block_size, eviction=config.eviction.value, num_workers=world,
                            replicated=breaks.mla, checksum=breaks.checksum,
                            lower_tiers=offload_config(config, shape).lower_tiers)
    pools = dist.new_group(backend="gloo")
    (worker, rank, caches), shared = register_in_turn(
        pools, breaks.mla, lambda shared: _register(offload, device, index, world, shared, shape,
                                                    engine_config.num_gpu_blocks))
    host = host_pool_bytes(device, shared, pools)
    if breaks.control in TP_WORKER_CONTROLS:
        TP_WORKER_CONTROLS[breaks.control](worker)
    if breaks.failing_rank == index:
        worker._transfers = EveryNthFails(worker._transfers, FAILING_EVERY)  # type: ignore[assignment]
    if breaks.skewed_rank == index:
        worker.get_finished = LateReports(worker.get_finished, breaks.skew_steps)  # type: ignore[method-assign]
    pacer = OneStepBehind(device) if isinstance(device, SimDevice) else None
    own_log = DeviceLogWorld(device, rank=index, num_workers=world, replicated=breaks.mla)

    def after_step() -> list[str]:
        """Let the simulated device lag a step, check this rank's device log, forget what can no longer race."""
        if pacer is None:
            return []
        pacer.after_step()
        found = [f"rank {index}: {name}: {line}"
                 for name, lines in check_all(own_log, DEVICE_LOG_INVARIANTS).items() for line in lines]
        pacer.forget_checked()
        return found

    try:
        if index == 0:
            scheduler = SchedulerConnector(offload, caches.gpu_block_bytes, keep_history=True,
                                           num_gpu_blocks=caches.num_blocks, tiers=worker.lower_tiers)
            if breaks.control in TP_CONTROLS:
                TP_CONTROLS[breaks.control](scheduler)
            ranks = DistributedRanks(rank, after_step)
            run = _lead(Engine(engine_config, ranks, scheduler), ranks, scheduler, arrivals, config, world)
            one_copy = worker.pool.num_slots * worker.pool.slot_bytes
            run = run.model_copy(update={"host_pool_bytes": host, "one_copy_bytes": one_copy})
            if breaks.mla:
                run = _single_writer(run, scheduler, _every_rank_sent(worker, pools), worker.pool.slot_bytes)
            result.write_text(run.model_dump_json())
        else:
            follow(rank, after_step, BlockOracle(shape, config.block_size_factor).prefix_bytes)
            if breaks.mla:
                _every_rank_sent(worker, pools)
    finally:
        worker.shutdown()
        if shared is not None:
            shared.close()


def _register(offload: OffloadConfig, device: Device, index: int, world: int, shared: SharedHostMemory | None,
              shape: ModelShape, num_gpu_blocks: int) -> tuple[WorkerConnector, Rank, KVCaches]:
    """This rank's worker half and its caches, registered (into the shared host memory with `--mla`)."""
    worker = WorkerConnector(offload, device, worker=index, shared_host=shared, keep_store_bytes=offload.replicated)
    rank = Rank(shape, num_gpu_blocks, device, index, world, worker, replicated=offload.replicated)
    return worker, rank, worker.register_kv_caches(rank.kv_caches, rank.layout)


def _every_rank_sent(worker: WorkerConnector, group: dist.ProcessGroup) -> list[dict[int, int]]:
    """Every rank's `store_bytes`, in rank order (every rank calls this once the run is over)."""
    every: list[dict[int, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, worker.store_bytes, group=group)
    return [sent or {} for sent in every]


def _single_writer(run: TpRun, scheduler: SchedulerConnector, sent: list[dict[int, int]], slot_bytes: int) -> TpRun:
    """`run` with what the ranks' store copies sent: its totals, and `replicated-single-writer`'s violations."""
    stored = [job for job in scheduler.jobs.values() if job.kind == "store" and job.state == TransferJobState.DONE]
    found = [f"replicated-single-writer: {line}"
             for line in replicated_single_writer_bytes(scheduler.jobs.values(), sent, slot_bytes)]
    return run.model_copy(update={
        "violations": run.violations + found,
        "store_pcie_bytes": sum(by_job.get(job.job_id, 0) for job in stored for by_job in sent),
        "store_one_copy_bytes": sum(len(job.cpu_slots) for job in stored) * slot_bytes})


def _lead(engine: Engine, ranks: DistributedRanks, scheduler: SchedulerConnector, arrivals: list, config: DemoConfig,
          world: int) -> TpRun:
    """Serve the workload from rank 0, checking the scheduler's invariants after every step, then verify every
    rank's pool and tokens."""
    state = EngineWorld(engine, scheduler)
    violations: list[str] = []

    def after_step() -> None:
        violations.extend(f"rank 0: {name}: {line}" for name, lines in check_all(state).items() for line in lines)

    start = time.perf_counter()
    try:
        serve_arrivals(engine, arrivals, after_step, lambda finished: None)
    except REFUSALS as refusal:  # every rank is between steps: the run stops there, and fails
        violations.append(f"rank 0: refused: {type(refusal).__name__}: {refusal}")
        ranks.stop()
        return _summary(engine, scheduler, world, time.perf_counter() - start, violations + ranks.violations)
    wall = time.perf_counter() - start
    oracle = BlockOracle(engine.config.model, config.block_size_factor)
    for request in engine.finished:
        oracle.learn(request.prompt, request.block_hashes)
    ready = [ReadySlot(slot=b.slot, prefix=oracle.tokens[b.block_hash]) for b in scheduler.manager.blocks
             if b.state == CpuBlockState.READY and b.block_hash is not None]
    checked = ranks.verify(ready, oracle.prefix_bytes)  # every device drained first
    violations += [f"rank 0: {name}: {line}" for name, lines in check_all(state).items() for line in lines]
    ranks.stop()
    return _summary(engine, scheduler, world, wall, violations + ranks.violations + checked)


def _summary(engine: Engine, scheduler: SchedulerConnector, world: int, wall: float, violations: list[str]) -> TpRun:
    stats = scheduler.stats
    tiers = scheduler.tiers.stats if scheduler.tiers is not None else None
    return TpRun(ranks=world, device=engine.device.kind, steps=engine.step_count, wall_s=wall,
                 outputs=engine.outputs(), violations=violations, cpu_hit_tokens=engine.cpu_hit_tokens,
                 blocks_stored=stats.blocks_stored, blocks_loaded=stats.blocks_loaded, loads_failed=stats.loads_failed,
                 stores_failed=stats.stores_failed, host_pool_bytes=0, one_copy_bytes=0,
                 blocks_written_back=sum(tiers.blocks_written_back.values()) if tiers else 0,
                 blocks_fetched=sum(tiers.blocks_fetched.values()) if tiers else 0)


def run_tp(config: DemoConfig, ranks: int = 2, breaks: Breaks = Breaks()) -> tuple[TpRun, dict[int, list[int]]]:
    """Serve `config`'s workload on `ranks` processes, and once in this process without offloading (the reference
    outputs), with `breaks` (a control, a failing rank, a skewed rank). A process that fails takes the others down;
    all have ended when this returns or raises."""
    kind = resolve_device(config.device)
    controls = {*TP_CONTROLS, *TP_WORKER_CONTROLS}
    if breaks.control is not None and breaks.control not in controls:
        raise DemoConfigError(f"unknown control {breaks.control!r}; known: {', '.join(sorted(controls))}")
    for option, rank in (("--failing-rank", breaks.failing_rank), ("--skewed-rank", breaks.skewed_rank)):
        if rank is not None and not 0 <= rank < ranks:
            raise DemoConfigError(f"{option} {rank}; legal: 0 to {ranks - 1}", option)
    if config.disk is not None and not breaks.mla:
        raise DemoConfigError("--disk under tensor parallelism needs --mla: one rank then moves the one shared copy "
                              "(without it each rank's tier would be its own heads' share, not built here)", "--disk")
    if breaks.skew_steps < 1:
        raise DemoConfigError(f"--skew-steps {breaks.skew_steps}; legal: 1 or more", "--skew-steps")
    if kind is DeviceKind.cuda and torch.cuda.device_count() < ranks:
        raise DemoConfigError(f"{ranks} ranks need {ranks} GPUs; torch sees {torch.cuda.device_count()}")
    shape = SIM_SHAPE if kind is DeviceKind.cpu else CUDA_SHAPE
    if shape.num_heads % ranks:
        raise DemoConfigError(f"{shape.num_heads} heads do not divide among {ranks} ranks")
    arrivals = generate(config.workload, shape.vocab, config.seed)
    reference = run_once(config, kind, engine_config_for(arrivals, config.gpu_blocks, shape), arrivals, offload=False)
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "rank0.json"
        mp.start_processes(_rank_main, nprocs=ranks, start_method="spawn", join=True,
                           args=(ranks, f"file://{folder}/rendezvous", kind, config, breaks, str(result)))
        return TpRun.model_validate_json(result.read_text()), reference.outputs


def verdict(run: TpRun, reference: dict[int, list[int]], mla: bool = False) -> list[str]:
    """Everything wrong with a run: violations, outputs that differ from the reference, poisoned reads, and with
    `mla` host pools of more than one copy."""
    found = list(dict.fromkeys(run.violations))  # a job that broke a rule is found again after every later step
    if mla and run.host_pool_bytes != run.one_copy_bytes:
        found.append(f"host pools hold {run.host_pool_bytes} bytes; one copy is {run.one_copy_bytes}")
    if run.outputs != reference:
        differ = sorted(h for h in reference if run.outputs.get(h) != reference[h])
        found.append(f"outputs differ from the single-process run without offloading for requests {differ[:8]}")
    found += [f"request {h} read a poisoned KV block" for h in poisoned(run.outputs)]
    return found


def render(run: TpRun, found: list[str]) -> Table:
    table = Table(title=f"TP={run.ranks} on {run.device}: {len(run.outputs)} requests, {run.steps} steps, "
                        f"{run.wall_s:.1f} s")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("prefix tokens served from CPU (reloaded)", str(run.cpu_hit_tokens))
    table.add_row("CPU blocks stored / loaded (each by every rank)", f"{run.blocks_stored} / {run.blocks_loaded}")
    table.add_row("stores / loads failed (on every rank)", f"{run.stores_failed} / {run.loads_failed}")
    table.add_row("host pool bytes, all ranks / one copy", f"{run.host_pool_bytes} / {run.one_copy_bytes}")
    if run.store_pcie_bytes is not None:
        table.add_row("store bytes over PCIe, all ranks / one copy", f"{run.store_pcie_bytes} / "
                                                                       f"{run.store_one_copy_bytes}")
    table.add_row("blocks written back / fetched (lower tiers, by rank 0)",
                  f"{run.blocks_written_back} / {run.blocks_fetched}")
    table.add_row("problems (invariants, bytes, tokens, outputs)", str(len(found)))
    return table


app = typer.Typer(add_completion=False)


@app.command()
def main(ranks: int = typer.Option(2, min=2, help="Tensor-parallel ranks, one process each."),
         device: DeviceKind = typer.Option(DeviceKind.auto, help="cuda: NCCL, one GPU per rank; cpu: gloo, "
                                                                  "SimDevice."),
         conversations: int = 16, agents: int = 8, turns: int = 6, gpu_blocks: int = 64, cpu_blocks: int = 512,
         seed: int = 0,
         control: str | None = typer.Option(None, help="Serve with a scheduler-half control to see it caught: "
                                                        f"{', '.join(sorted(TP_CONTROLS))}."),
         failing_rank: int | None = typer.Option(None, help="This rank's every third store or load fails (the "
                                                            "others' succeed): each such job must fail everywhere."),
         skewed_rank: int | None = typer.Option(None, help="This rank's reports reach the scheduler late: each job "
                                                           "must end only on its last rank's report."),
         skew_steps: int = typer.Option(SKEW_STEPS, help="How many steps late --skewed-rank reports."),
         mla: bool = typer.Option(False, "--mla", help="Replicated KV (MLA-shaped caches): one host pool shared by "
                                                       "the ranks, each store copied by one rank."),
         disk: Path | None = typer.Option(None, "--disk", help="With --mla: a disk tier in this directory below the "
                                                                "shared pool, moved by rank 0 alone."),
         disk_blocks: int = typer.Option(4096, min=1, help="The disk tier's capacity in CPU blocks."),
         checksum: bool = typer.Option(False, "--checksum", help="Check every load against its block's checksum."),
         json_out: Path | None = typer.Option(None, "--json", help="Also write the run as JSON here.")) -> None:
    """Serve the demo workload with tensor parallelism and check it; exit code 1 if anything is wrong."""
    workload = WorkloadShape(conversations=conversations, agents=agents, turns=turns)
    config = DemoConfig(workload=workload, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, device=device, seed=seed,
                        disk=disk, disk_blocks=disk_blocks)
    try:
        run, reference = run_tp(config, ranks, Breaks(control, failing_rank, skewed_rank, skew_steps, mla, checksum))
    except DemoConfigError as error:
        raise typer.BadParameter(str(error), param_hint=error.option) from None
    found = verdict(run, reference, mla)
    console = Console(width=120)
    console.print(render(run, found))
    for line in found[:20]:
        console.print(f"[red]{line}[/red]")
    if json_out is not None:
        json_out.write_text(json.dumps({**run.model_dump(), "found": found}, indent=1))
    console.print("[green]PASS[/green]: invariants, bytes on every rank, tokens and outputs all hold" if not found
                  else f"[red]FAILED[/red]: {len(found)} problems")
    raise typer.Exit(1 if found else 0)


if __name__ == "__main__":
    app()
