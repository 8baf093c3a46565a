"""`python -m kvfsm.demo`: the reference engine serves returning prefixes twice, without offloading and with kvfsm.

GPU KV memory is deliberately too small for the workload (`kvfsm.workload`), so the engine's prefix cache forgets
prefixes before they return. Without offloading they are recomputed; with kvfsm they reload from the CPU pool.
Both runs must produce the same tokens, the spec's invariants must hold after every step of the kvfsm run, and no
request may read a poisoned block: anything else fails the run (exit code 1).

On `SimDevice` the virtual GPU runs up to one engine step behind the host, as it may under async scheduling, and
picks the next stream at random (seeded) among those that may run: a store, a load and the next step's compute
really do overtake one another. (The CPU that runs the simulator is the one that would run the GPU, so the lag buys
no speed here; it is there so the ordering rules are exercised. The generated interleavings in the test suite
explore every lag and every schedule.) Accesses that can no longer be overtaken are dropped from the device's log
once checked, so checking stays linear in the length of the run.
"""

from __future__ import annotations

import random
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Callable, Iterator, Literal

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvfsm.config import DiskTierConfig, LowerTierConfig, MooncakeTierConfig, OffloadConfig
from kvfsm.mooncake.errors import TierFault
from kvfsm.mooncake.local import LocalMooncake, MooncakeProcessError
from kvfsm.connector import Connector
from kvfsm.connector.scheduler import UnknownJob, UnknownRequest
from kvfsm.connector.stats import ConnectorStats
from kvfsm.engine.engine import Engine, EngineConfig
from kvfsm.engine.model import ModelShape
from kvfsm.executor.cuda import CudaDevice
from kvfsm.executor.device import STREAMS, Device
from kvfsm.executor.sim import SimDevice, SimEvent
from kvfsm.invariants import check_all
from kvfsm.machines import IllegalTrigger
from kvfsm.manager.catalogue import ManagerError
from kvfsm.testing.mutants import MUTANTS
from kvfsm.testing.oracle import poisoned
from kvfsm.testing.trace import TraceRecorder
from kvfsm.testing.world import EngineWorld
from kvfsm.connector.tier_planner import TierStats
from kvfsm.workload import Arrival, WorkloadShape, generate, minimum_compute

SIM_SHAPE = ModelShape(num_layers=2, num_heads=2, head_dim=8, block_size=8)
"""Small enough that a 2-core CPU serves the default workload in seconds."""
CUDA_SHAPE = ModelShape(num_layers=8, num_heads=8, head_dim=128, block_size=8)
"""Same paging as on the CPU (so the same GPU block count means the same pressure); 256 KiB per GPU block."""
MAX_STEPS_PER_REQUEST = 50
"""A run taking more engine steps than this per request (beyond the last arrival) has stalled."""
DISK_DEMO_CPU_BLOCKS = 32
"""With a disk tier, a CPU pool this small holds a fraction of the workload's prefixes: the rest come from disk."""
SHOWN_BY_THE_WORKLOAD = ("no-compute-barrier", "no-load-dedup", "no-preemption-flush", "no-write-after-read-wait")
"""The controls whose bug the default workload's seeded schedule exposes; the others need a race that only the test
suite's chosen schedules (generated interleavings, exhaustive explorer) set up."""
REFUSALS = (IllegalTrigger, ManagerError, UnknownJob, UnknownRequest)
"""What kvfsm raises when asked to move a lifecycle where the spec forbids (a control can provoke it)."""
EXAMPLES_KEPT = 3
"""Violation lines kept per invariant for the report."""


class DeviceKind(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Eviction(str, Enum):
    lru = "lru"
    arc = "arc"


class DemoConfigError(ValueError):
    """A demo configuration that cannot serve its workload (a request larger than the GPU cache, no CUDA)."""


class DemoStalled(RuntimeError):
    """The engine stopped making progress: a request never finished."""


@dataclass(frozen=True)
class DemoConfig:
    workload: WorkloadShape = WorkloadShape()
    gpu_blocks: int = 64
    cpu_blocks: int = 512
    block_size_factor: int = 1
    eviction: Eviction = Eviction.lru
    device: DeviceKind = DeviceKind.auto
    seed: int = 0
    mutant: str | None = None
    """Serve with one of `kvfsm.testing.mutants.MUTANTS` (a guarded rule removed), to see the check catch it."""
    disk: Path | None = None
    """A directory for a disk tier below the CPU pool (None: no disk tier)."""
    disk_blocks: int = 4096
    writeback: Literal["eager", "on-evict"] = "eager"
    mooncake_master: str | None = None
    """HOST:PORT of a `mooncake_master` for a shared Mooncake tier below the CPU pool (and the disk, if any)."""

    def __post_init__(self) -> None:
        if self.mutant is not None and self.mutant not in MUTANTS:
            raise DemoConfigError(f"unknown mutant {self.mutant!r}; known: {', '.join(sorted(MUTANTS))}")


@dataclass
class RunReport:
    """What one run did; `stats` and `violations` exist only for the run with kvfsm."""

    device: str
    outputs: dict[int, list[int]]
    steps: int
    wall_s: float
    """Serving time, without the time spent checking invariants (`check_s`)."""
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int
    preemptions: int
    stats: ConnectorStats | None = None
    tier_stats: TierStats | None = None
    check_s: float = 0.0
    violations: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def record(self, found: dict[str, list[str]]) -> None:
        for name, lines in found.items():
            self.violations[name] = self.violations.get(name, 0) + len(lines)
            kept = self.examples.setdefault(name, [])
            kept.extend(lines[:EXAMPLES_KEPT - len(kept)])


@dataclass(frozen=True)
class DemoResult:
    config: DemoConfig
    requests: int
    minimum_compute: int
    baseline: RunReport
    offloaded: RunReport

    @property
    def outputs_identical(self) -> bool:
        return len(self.baseline.outputs) == self.requests and self.offloaded.outputs == self.baseline.outputs

    @property
    def poisoned(self) -> list[int]:
        return sorted(set(poisoned(self.baseline.outputs)) | set(poisoned(self.offloaded.outputs)))

    @property
    def ok(self) -> bool:
        return self.outputs_identical and not self.offloaded.violations and not self.poisoned


def resolve_device(kind: DeviceKind) -> DeviceKind:
    """`auto` is CUDA when torch sees a GPU, else the CPU simulator; asking for absent CUDA is an error."""
    if kind is DeviceKind.auto:
        return DeviceKind.cuda if torch.cuda.is_available() else DeviceKind.cpu
    if kind is DeviceKind.cuda and not torch.cuda.is_available():
        raise DemoConfigError("--device cuda was asked for, but torch sees no CUDA device")
    return kind


def engine_config_for(arrivals: list[Arrival], gpu_blocks: int, shape: ModelShape) -> EngineConfig:
    """The engine admits a request only whole, so the batch budget and the GPU cache must fit the longest one."""
    longest = max(len(a.prompt) + a.max_new_tokens for a in arrivals)
    needed = -(-longest // shape.block_size)
    if needed > gpu_blocks:
        raise DemoConfigError(f"the longest request needs {needed} GPU blocks of {shape.block_size} tokens; "
                              f"--gpu-blocks is {gpu_blocks}")
    return EngineConfig(num_gpu_blocks=gpu_blocks, max_batched_tokens=2 * longest, model=shape)


def _new_device(kind: DeviceKind, seed: int) -> Device:
    """On the simulator, a seeded random schedule: stores, loads and compute interleave differently each step."""
    return CudaDevice() if kind is DeviceKind.cuda else SimDevice(random.Random(seed).choice)


class OneStepBehind:
    """Lets the simulated GPU run up to one engine step behind the host, as async scheduling allows on a real one.

    After each step a marker is recorded on every stream, and the host waits for the previous step's markers: step
    N's device work may still be running (interleaved at random with step N+1's) when step N+1 is scheduled."""

    def __init__(self, device: SimDevice) -> None:
        self.device = device
        self._previous: list[SimEvent] = []
        self._settled = 0

    def after_step(self) -> None:
        markers = [self.device.new_event() for _ in STREAMS]
        for stream, marker in zip(STREAMS, markers):
            self.device.record(stream, marker)
        for marker in self._previous:
            self.device.synchronize(marker)
        self._settled = min((m.latest.issued for m in self._previous if m.latest is not None), default=0)
        self._previous = markers

    def forget_checked(self) -> None:
        """Drop accesses of operations issued before the last markers waited for, once they have been checked.

        All of those ran, and anything not yet run was issued after them, so none of theirs can still be
        overtaken by an operation issued earlier: the ordering invariants have nothing more to find in them."""
        self.device.accesses[:] = [a for a in self.device.accesses if a.issued >= self._settled]

    def finish(self) -> None:
        self.device.run_until_idle()


def serve_arrivals(engine: Engine, arrivals: list[Arrival], after_step: Callable[[], None],
           progress: Callable[[int], None]) -> None:
    """Submit each request at its arrival step and step the engine until everything finished."""
    pending = deque(arrivals)
    limit = arrivals[-1].step + MAX_STEPS_PER_REQUEST * len(arrivals)
    clock = 0
    while pending or engine.has_work:
        while pending and pending[0].step <= clock:
            arrival = pending.popleft()
            engine.add_request(arrival.request_id, arrival.prompt, arrival.max_new_tokens)
        if not engine.has_work:
            clock = pending[0].step  # idle until the next arrival
            continue
        engine.step()
        after_step()
        progress(len(engine.finished))
        clock += 1
        if engine.step_count > limit:
            raise DemoStalled(f"{len(engine.live)} requests unfinished after {engine.step_count} steps")


def run_once(config: DemoConfig, kind: DeviceKind, engine_config: EngineConfig, arrivals: list[Arrival],
             offload: bool, progress: Callable[[int], None] = lambda finished: None) -> RunReport:
    """Serve the workload on a fresh device, with kvfsm if `offload`; checks every invariant after every step."""
    shape = engine_config.model
    device = _new_device(kind, config.seed)
    connector = None
    if offload:
        block_bytes = config.block_size_factor * shape.gpu_block_bytes
        tiers: tuple[LowerTierConfig, ...] = (DiskTierConfig(
            path=config.disk, capacity_bytes=config.disk_blocks * block_bytes, writeback=config.writeback),
        ) if config.disk is not None else ()
        if config.mooncake_master is not None:
            tiers += (MooncakeTierConfig(master=config.mooncake_master, model_id="kvfsm-demo-toy",
                                         kv_dtype=str(shape.dtype), writeback=config.writeback),)
        connector = Connector(OffloadConfig(cpu_blocks=config.cpu_blocks, block_size_factor=config.block_size_factor,
                                            gpu_block_size=shape.block_size, eviction=config.eviction.value,
                                            lower_tiers=tiers),
                              device, keep_history=True)
    engine = Engine(engine_config, device, connector)
    if connector is not None and config.mutant is not None:
        MUTANTS[config.mutant].apply(engine, connector)
    report = RunReport(device=device.kind, outputs={}, steps=0, wall_s=0.0, gpu_hit_tokens=0, cpu_hit_tokens=0,
                       computed_tokens=0, preemptions=0)
    world = EngineWorld(engine, connector) if connector is not None else None
    trace = TraceRecorder(connector.machines) if connector is not None else None

    pacer = OneStepBehind(device) if isinstance(device, SimDevice) else None

    def check() -> None:
        if world is not None:
            checking = time.perf_counter()
            report.record(check_all(world))
            report.check_s += time.perf_counter() - checking

    def after_step() -> None:
        if pacer is not None:
            pacer.after_step()
        check()
        if pacer is not None:
            pacer.forget_checked()

    start = time.perf_counter()
    try:
        serve_arrivals(engine, arrivals, after_step, progress)
        if pacer is not None:
            pacer.finish()
        else:
            torch.cuda.synchronize()
        report.wall_s = time.perf_counter() - start - report.check_s
        check()  # engine and device are idle now, so `drained` is checked too
        if trace is not None and (drift := trace.check()):  # cumulative: every transition of the run
            report.record({"trace": drift})
    except REFUSALS as refusal:  # kvfsm refused what the spec forbids: the run stops there, and fails
        report.record({"refused": [f"{type(refusal).__name__}: {refusal}"]})
    finally:
        if trace is not None:
            trace.close()
        if connector is not None:
            connector.worker.shutdown()
    report.outputs = engine.outputs()
    report.steps = engine.step_count
    report.gpu_hit_tokens, report.cpu_hit_tokens = engine.gpu_hit_tokens, engine.cpu_hit_tokens
    report.computed_tokens, report.preemptions = engine.computed_tokens, engine.preemptions
    report.stats = connector.scheduler.stats if connector is not None else None
    planner = connector.scheduler.tiers if connector is not None else None
    report.tier_stats = planner.stats if planner is not None else None
    return report


@contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """The simulator's tensors are tiny: torch's intra-op threads only spin, and on a busy 2-core machine that
    spinning made a run 30x slower (measured). One thread for the duration, then torch's setting is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_demo(config: DemoConfig, progress: Progress | None = None) -> DemoResult:
    """The workload served without offloading, then with kvfsm, on the same kind of device."""
    kind = resolve_device(config.device)
    shape = SIM_SHAPE if kind is DeviceKind.cpu else CUDA_SHAPE
    arrivals = generate(config.workload, shape.vocab, config.seed)
    engine_config = engine_config_for(arrivals, config.gpu_blocks, shape)
    reports = []
    with _one_cpu_thread() if kind is DeviceKind.cpu else nullcontext():
        for label, offload in (("without offloading", False), ("with kvfsm", True)):
            advance: Callable[[int], None] = lambda finished: None
            if progress is not None:
                task = progress.add_task(label, total=len(arrivals))
                advance = lambda finished, task=task: progress.update(task, completed=finished)  # noqa: E731
            reports.append(run_once(config, kind, engine_config, arrivals, offload, advance))
    return DemoResult(config, len(arrivals), minimum_compute(arrivals, shape.block_size), *reports)


def _rate(nbytes: int, seconds: float) -> str:
    if seconds <= 0:
        return "-"
    rate = nbytes / seconds
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e8 else f"{rate / 1e6:.2f} MB/s"


def render(result: DemoResult) -> Table:
    """The two runs side by side, then the integrity verdict."""
    base, off = result.baseline, result.offloaded
    stats = off.stats or ConnectorStats()
    simulated = off.device == "sim"
    table = Table(title=f"{result.requests} requests on {'SimDevice (CPU)' if simulated else 'CUDA'}, "
                        f"{result.config.gpu_blocks} GPU blocks, {result.config.cpu_blocks} CPU blocks "
                        f"(factor {result.config.block_size_factor}, {result.config.eviction.value})")
    table.add_column("")
    table.add_column("without offloading", justify="right")
    table.add_column("with kvfsm", justify="right")

    def row(name: str, without: object, with_: object) -> None:
        table.add_row(name, str(without), str(with_))

    tiers = off.tier_stats
    from_below = sum(tiers.tokens_loaded_from.values()) if tiers is not None else 0
    row("prefix tokens served from GPU", base.gpu_hit_tokens, off.gpu_hit_tokens)
    row("prefix tokens served from CPU (reloaded)", 0, off.cpu_hit_tokens - from_below)
    if tiers is not None:
        for tier in tiers.blocks_written_back.keys() | tiers.tokens_loaded_from.keys():
            row(f"prefix tokens served from {tier} (fetched to CPU, reloaded)", 0, tiers.tokens_loaded_from[tier])
            row(f"CPU→{tier} written back / {tier}→CPU fetched (blocks)", "-",
                f"{tiers.blocks_written_back[tier]} / {tiers.blocks_fetched[tier]}")
        row("lower-tier keys that failed to move", "-",
            ", ".join(f"{k} {n}" for k, n in tiers.failures.items()) or "0")
    row("tokens computed", base.computed_tokens, off.computed_tokens)
    row("  of which recomputed (beyond an unbounded cache)",
        max(0, base.computed_tokens - result.minimum_compute), max(0, off.computed_tokens - result.minimum_compute))
    row("preemptions", base.preemptions, off.preemptions)
    row("GPU→CPU stored (blocks / MB)", "-", f"{stats.blocks_stored} / {stats.bytes_stored / 1e6:.2f}")
    row("CPU→GPU loaded (blocks / MB)", "-", f"{stats.blocks_loaded} / {stats.bytes_loaded / 1e6:.2f}")
    over = "averaged over wall time" + (", simulated" if simulated else "")
    row(f"store rate ({over})", "-", _rate(stats.bytes_stored, off.wall_s))
    row(f"load rate ({over})", "-", _rate(stats.bytes_loaded, off.wall_s))
    row("lookups deferred / stores refused", "-", f"{stats.deferrals} / {stats.store_refusals}")
    row("engine steps", base.steps, off.steps)
    row("wall time serving (s)", f"{base.wall_s:.2f}", f"{off.wall_s:.2f}")
    row("wall time checking invariants (s)", "-", f"{off.check_s:.2f}")
    table.add_section()
    identical = "identical" if result.outputs_identical else "DIFFERENT"
    table.add_row("outputs vs run without offloading", "", identical)
    checked = "all steps" if simulated else "all steps; state only: CUDA keeps no access log for the ordering ones"
    table.add_row(f"invariant violations ({checked})", "", str(sum(off.violations.values())))
    table.add_row("requests that read poisoned KV", "", str(len(result.poisoned)))
    table.add_row("integrity", "", "[green]PASS[/green]" if result.ok else "[red]FAIL[/red]")
    return table


app = typer.Typer(add_completion=False, help=__doc__.split("\n")[0])


@contextmanager
def _mooncake_deployment(start: bool, address: str | None) -> Iterator[str | None]:
    """The master the demo uses: the one given, one started on loopback for the run (and stopped after), or none."""
    if address is not None or not start:
        yield address
        return
    with LocalMooncake() as deployment:
        yield str(deployment.address)


@app.command()
def main(
    conversations: int = typer.Option(WorkloadShape.conversations, min=0, help="Multi-turn conversations."),
    turns: int = typer.Option(WorkloadShape.turns, min=1, help="Turns per conversation and calls per agent."),
    agents: int = typer.Option(WorkloadShape.agents, min=0, help="Agents sharing one long prefix."),
    gpu_blocks: int = typer.Option(DemoConfig.gpu_blocks, min=1,
                                   help=f"GPU KV cache size in blocks of {SIM_SHAPE.block_size} tokens."),
    cpu_blocks: int = typer.Option(None, min=1, help=f"Pinned CPU pool size in CPU blocks [default: "
                                                     f"{DemoConfig.cpu_blocks}, or {DISK_DEMO_CPU_BLOCKS} with --disk]",
                                   show_default=False),
    block_size_factor: int = typer.Option(DemoConfig.block_size_factor, min=1, help="GPU blocks per CPU block."),
    eviction: Eviction = typer.Option(DemoConfig.eviction, help="CPU pool eviction policy."),
    device: DeviceKind = typer.Option(DemoConfig.device, help="cuda: CudaDevice; cpu: SimDevice; auto: cuda if "
                                                              "torch sees a GPU."),
    seed: int = typer.Option(DemoConfig.seed, help="Seed of the workload (tokens, think times, session order) "
                                                  "and of the simulator's stream schedule."),
    mutant: str | None = typer.Option(None, help="Serve with a guarded rule removed, to watch integrity fail "
                                                 "(on the simulator; a real GPU may not lose the race). The default "
                                                 "workload fails with " + ", ".join(SHOWN_BY_THE_WORKLOAD) + ". "
                                                 + ", ".join(sorted(set(MUTANTS) - set(SHOWN_BY_THE_WORKLOAD)))
                                                 + " pass here: their race needs a schedule that only the test "
                                                 "suite's generated interleavings and explorer set up."),
    disk: Path = typer.Option(None, help="Put a disk tier below the CPU pool, in this directory (its slot file is "
                                         "removed at exit); the CPU pool then defaults small, so prefixes reach disk."),
    disk_blocks: int = typer.Option(DemoConfig.disk_blocks, help="Disk tier size in CPU blocks."),
    writeback: str = typer.Option(DemoConfig.writeback, help="When CPU blocks are written back to disk: eager "
                                                             "(after their store) or on-evict (before eviction)."),
    mooncake: bool = typer.Option(False, "--mooncake", help="Put a shared Mooncake tier below the CPU pool, on a "
                                  "local mooncake_master started for the run (needs the mooncake extra)."),
    mooncake_master: str = typer.Option(None, help="Use the Mooncake master at HOST:PORT instead of starting one."),
) -> None:
    """Serve a workload whose prefixes outgrow the GPU cache, without and with kvfsm; exit 1 on any integrity loss."""
    console = Console()
    try:
        shape = WorkloadShape(conversations=conversations, turns=turns, agents=agents)
        lower = disk is not None or mooncake or mooncake_master is not None
        if cpu_blocks is None:
            cpu_blocks = DISK_DEMO_CPU_BLOCKS if lower else DemoConfig.cpu_blocks
        if writeback not in ("eager", "on-evict"):
            raise DemoConfigError(f"--writeback must be eager or on-evict, not {writeback!r}")
        with _mooncake_deployment(mooncake, mooncake_master) as master:
            config = DemoConfig(shape, gpu_blocks, cpu_blocks, block_size_factor, eviction, device, seed, mutant,
                                disk, disk_blocks, writeback, master)  # type: ignore[arg-type]
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("requests"), TimeElapsedColumn(), console=console) as progress:
                result = run_demo(config, progress)
    except (ValueError, MooncakeProcessError, TierFault) as err:  # bad options, or a Mooncake that cannot serve
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(code=2) from None
    console.print(render(result))
    for name, lines in result.offloaded.examples.items():
        console.print(f"[red]{name}[/red] ({result.offloaded.violations[name]}): " + "; ".join(lines))
    if not result.ok:
        raise typer.Exit(code=1)


if __name__ == "__main__":
    app()
