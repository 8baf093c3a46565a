"""`python -m kvfsm.demo`: the reference engine serves returning prefixes twice, without offloading and with kvfsm.

The command line of the demo: its options become a `DemoConfig` (starting a local Mooncake master for the run when
asked), the two runs show their progress, and the result is printed as a table with the examples of any violation.
The exit status is the verdict: 0 when integrity held, 1 when it did not, 2 for options that cannot run (or a
Mooncake tier that cannot serve).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvfsm.demo.config import SIM_SHAPE, DemoConfig, DemoConfigError, DeviceKind, Eviction
from kvfsm.demo.runs import run_demo
from kvfsm.demo.switches import MUTANTS
from kvfsm.demo.table import render
from kvfsm.mooncake.errors import TierFault
from kvfsm.mooncake.local import LocalMooncake, MooncakeProcessError
from kvfsm.workload import WorkloadShape

DISK_DEMO_CPU_BLOCKS = 32
"""With a disk tier, a CPU pool this small holds a fraction of the workload's prefixes: the rest come from disk."""
SHOWN_BY_THE_WORKLOAD = ("no-compute-barrier", "no-load-dedup", "no-preemption-flush", "no-write-after-read-wait")
"""The controls whose bug the default workload's seeded schedule exposes; the others need a race that only the test
suite's chosen schedules (generated interleavings, exhaustive explorer) set up."""

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
