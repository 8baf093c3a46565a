"""`python -m kvfsm.demo`: the reference engine serves returning prefixes twice, without offloading and with kvfsm.

The command line of the demo: its options become a `DemoConfig`, checked whole (`kvfsm.demo.plan`) before any work
runs, a local Mooncake master is started for the run when asked, the two runs show their progress, and the result
is printed as a table with the examples of any violation. The exit status is the verdict: 0 when integrity held,
1 when it did not, 2 for options that cannot run (typer's usage error, one line naming the option) or a Mooncake
tier that cannot serve. Everything that imports torch is imported once the options are parsed, so `--help` is
quick.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvfsm.config import WriteBack
from kvfsm.demo.config import GPU_BLOCK_TOKENS, DemoConfig, DemoConfigError, DeviceKind, Eviction
from kvfsm.mooncake.errors import TierFault
from kvfsm.mooncake.local import LocalMooncake, MooncakeProcessError
from kvfsm.options import folder_option
from kvfsm.workload import WorkloadError, WorkloadShape

if TYPE_CHECKING:
    from kvfsm.demo.plan import DemoPlan

DISK_DEMO_CPU_BLOCKS = 32
"""With a disk tier, a CPU pool this small holds a fraction of the workload's prefixes: the rest come from disk."""
SHOWN_BY_THE_WORKLOAD = ("no-compute-barrier", "no-load-dedup", "no-preemption-flush", "no-write-after-read-wait",
                         "unpinned-load")
"""The controls whose bug the default workload's seeded schedule exposes; the others need a race that only the test
suite's chosen schedules (generated interleavings, exhaustive explorer) set up. `unpinned-load` shows as
`single-load`, not `readers-pin`: with its readers dropped as the load starts, a block still loading looks idle
to the next request's lookup, which orders a second load of the same CPU slot."""
OPTION_OF_FIELD = {
    "cpu_blocks": "--cpu-blocks", "block_size_factor": "--block-size-factor", "eviction": "--eviction",
    "path": "--disk", "capacity_bytes": "--disk-blocks", "writeback": "--writeback", "master": "--mooncake-master",
    "host": "--mooncake-master", "port": "--mooncake-master",
}
"""The option that sets each field of the `OffloadConfig` a `DemoConfig` resolves to, to name it when pydantic
refuses the field."""

app = typer.Typer(add_completion=False, help=__doc__.split("\n")[0])


@contextmanager
def _local_master(start: bool) -> Iterator[str | None]:
    """HOST:PORT of a master started on loopback for the run (and stopped after), or None when not asked."""
    if not start:
        yield None
        return
    with LocalMooncake() as deployment:
        yield str(deployment.address)


def _planned(ctx: typer.Context, make: Callable[[], DemoConfig]) -> DemoPlan:
    """The configuration `make` builds, checked by `plan_demo`; a refusal becomes typer's usage error: exit 2,
    one line naming the option."""
    from pydantic import ValidationError

    from kvfsm.demo.plan import plan_demo

    try:
        return plan_demo(make())
    except WorkloadError as err:  # the options' `min` leave one: no session at all
        raise typer.BadParameter(str(err), ctx=ctx, param_hint="--conversations, --agents") from None
    except DemoConfigError as err:
        raise typer.BadParameter(str(err), ctx=ctx, param_hint=err.option) from None
    except ValidationError as err:
        first = err.errors()[0]
        field = next((part for part in reversed(first["loc"]) if isinstance(part, str)), "")
        raise typer.BadParameter(f"{first['msg']} (got {first['input']!r})", ctx=ctx,
                                 param_hint=OPTION_OF_FIELD.get(field)) from None


def _warn_if_nothing_stored(console: Console, config: DemoConfig, stored: int, refused: int) -> None:
    """A run that stored no block passes having checked no offloading: say so, rather than a silent PASS. (One
    that provably cannot store is refused before it runs; one CPU block, say, may still hold a request's block.)"""
    if stored == 0:
        console.print(f"[yellow]warning:[/yellow] kvfsm stored no block (--cpu-blocks {config.cpu_blocks}, "
                      f"--block-size-factor {config.block_size_factor}; {refused} stores refused for want of CPU "
                      "space), so this PASS checked no offloading")


@app.command()
def main(
    ctx: typer.Context,
    conversations: int = typer.Option(WorkloadShape.conversations, min=0, help="Multi-turn conversations."),
    turns: int = typer.Option(WorkloadShape.turns, min=1, help="Turns per conversation and calls per agent."),
    agents: int = typer.Option(WorkloadShape.agents, min=0, help="Agents sharing one long prefix."),
    gpu_blocks: int = typer.Option(DemoConfig.gpu_blocks, min=1,
                                   help=f"GPU KV cache size in blocks of {GPU_BLOCK_TOKENS} tokens."),
    cpu_blocks: int = typer.Option(None, min=1, help=f"Pinned CPU pool size in CPU blocks [default: "
                                                     f"{DemoConfig.cpu_blocks}, or {DISK_DEMO_CPU_BLOCKS} with --disk]",
                                   show_default=False),
    block_size_factor: int = typer.Option(DemoConfig.block_size_factor, min=1,
                                          help="GPU blocks per CPU block; a CPU block longer than every request is "
                                               "refused, as nothing could be stored."),
    eviction: Eviction = typer.Option(DemoConfig.eviction, metavar="POLICY",
                                      help="CPU pool eviction policy: " + ", ".join(e.value for e in Eviction) + "."),
    device: DeviceKind = typer.Option(DemoConfig.device, help="cuda: CudaDevice; cpu: SimDevice; auto: cuda if "
                                                              "torch sees a GPU."),
    seed: int = typer.Option(DemoConfig.seed, help="Seed of the workload (tokens, think times, session order) "
                                                  "and of the simulator's stream schedule."),
    mutant: str | None = typer.Option(None, help="Serve with a guarded rule removed (a control of "
                                                 "kvfsm.demo.switches; an unknown name is refused with the list), "
                                                 "to watch integrity fail (on the simulator; a real GPU may not "
                                                 "lose the race). The default workload fails with "
                                                 + ", ".join(SHOWN_BY_THE_WORKLOAD) + ". The others' races need "
                                                 "a schedule that only the test suite's generated interleavings "
                                                 "and explorer set up (or a lower tier), so they may pass here."),
    disk: Path = folder_option(None, "--disk", help="Put a disk tier below the CPU pool, in this directory (its "
                                                    "blocks are removed at exit); the CPU pool then defaults "
                                                    "small, so prefixes reach disk."),
    disk_blocks: int = typer.Option(DemoConfig.disk_blocks, min=1, help="Disk tier size in CPU blocks."),
    writeback: WriteBack = typer.Option(DemoConfig.writeback, help="When CPU blocks are written back to disk: "
                                                                   "eager (after their store) or on-evict "
                                                                   "(before eviction)."),
    mooncake: bool = typer.Option(False, "--mooncake", help="Put a shared Mooncake tier below the CPU pool, on a "
                                  "local mooncake_master started for the run (needs the mooncake extra)."),
    mooncake_master: str = typer.Option(None, help="Use the Mooncake master at HOST:PORT instead of starting one."),
) -> None:
    """Serve a workload whose prefixes outgrow the GPU cache, without and with kvfsm; exit 1 on any integrity loss."""
    from kvfsm.demo.runs import run_plan
    from kvfsm.demo.table import render

    console = Console()
    if cpu_blocks is None:
        lower = disk is not None or mooncake or mooncake_master is not None
        cpu_blocks = DISK_DEMO_CPU_BLOCKS if lower else DemoConfig.cpu_blocks
    plan = _planned(ctx, lambda: DemoConfig(  # every option checked before a local master starts or a run begins
        WorkloadShape(conversations=conversations, turns=turns, agents=agents), gpu_blocks, cpu_blocks,
        block_size_factor, eviction, device, seed, mutant, disk, disk_blocks, writeback,  # type: ignore[arg-type]
        mooncake_master))
    try:
        with _local_master(mooncake and mooncake_master is None) as started:
            if started is not None:
                asked = plan.config
                plan = _planned(ctx, lambda: replace(asked, mooncake_master=started))
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("requests"), TimeElapsedColumn(), console=console) as progress:
                result = run_plan(plan, progress)
    except (MooncakeProcessError, TierFault) as err:  # a Mooncake that cannot serve
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(code=2) from None
    console.print(render(result))
    for name, lines in result.offloaded.examples.items():
        console.print(f"[red]{name}[/red] ({result.offloaded.violations[name]}): " + "; ".join(lines))
    if result.offloaded.stats is not None:
        _warn_if_nothing_stored(console, plan.config, result.offloaded.stats.blocks_stored,
                                result.offloaded.stats.store_refusals)
    if not result.ok:
        raise typer.Exit(code=1)
