"""A hybrid cache's round trip, and the out-of-window reuse race with its controls: `python -m kvfsm.testing.hybrid_race`.

A trial on the rig of `kvfsm.testing.hybrid_rig` (a full-attention group, a sliding window and a state, one block pool):
1. a writer computes a prompt; the step orders its stores (prompt-only admission, vLLM's connector's default): every
   full-attention block, the window at the prompt's end and the state's block;
2. the next step sends them, the full-attention blocks first, and the writer computes a burst of tokens that carries its
   window past every block those stores read (the decode steps a window takes to move on, while a store is still
   copying: on a loaded engine, stores queued behind others). With blocks of two tokens (the simulator's) the state's
   stored block is behind its one-block window already in this step, and the writer's own next block takes it;
3. the next step takes the window's blocks back and hands them at once to an intruder, whose poison and prefill go on
   the compute stream right after the allocation. kvfsm flushes every store still reading a handed-out block and the
   worker waits for it first (`window-fence`, the lazy fence of a running request);
4. both end, everything drains, and a reader of the writer's prompt reloads it from the CPU pool into freshly poisoned
   blocks; each group's reloaded bytes are compared with what the writer computed.
The round trip is the same without steps 2 and 3.

Controls: `no-lazy-fence` (the spec's mutant: a step hands out a freed-while-read block and flushes nothing) and
`no-slide` (an engine that never tells kvfsm its window moved on: the blocks look held, nothing is fenced). On CUDA the
copy engine lags by itself: 2 GiB of full-attention blocks are copied before the window's, long after the intruder
wrote; those trials run unchecked, the host as fast as an engine's in production (the checks would cost it longer than
the copies), and the rules are checked on the simulator's trials and on the GPU's round trip. On `SimDevice`
(`lag_copies`) the store stream is left behind between steps: the same order, chosen, every trial checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Literal

import torch
import typer
from rich.console import Console
from rich.table import Table

from kvfsm.executor import CudaDevice, Device, SimDevice
from kvfsm.testing.hybrid_cache import HybridShape
from kvfsm.testing.hybrid_rig import HybridRig
from kvfsm.testing.mutants import MUTANTS


@dataclass(frozen=True)
class Scenario:
    """The cache and the writer's prompt; the pools are sized for one trial."""

    shape: HybridShape
    prompt_blocks: int

    @property
    def cpu_blocks(self) -> int:
        """One trial's stores (the writer's and the intruder's): each trial evicts the one before's."""
        return self.prompt_blocks + 3 * self.shape.window_blocks + 2


def _scenario(layout: str, layers: int, block_tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
              prompt_blocks: int, window_blocks: int) -> Scenario:
    """GPU blocks for the writer at its longest, the intruder, and the null block."""
    blocks = 3 * (prompt_blocks + window_blocks) + 3 * (window_blocks + 1) + 1
    return Scenario(HybridShape(layout, layers, block_tokens, heads, head_dim, dtype, blocks, window_blocks),
                    prompt_blocks)


SIM = _scenario("kv-first", layers=2, block_tokens=2, heads=1, head_dim=4, dtype=torch.float16, prompt_blocks=6,
                window_blocks=2)
"""Small: the simulator's schedule makes the race, not the sizes."""
GPU = _scenario("cross-layer", layers=32, block_tokens=16, heads=32, head_dim=128, dtype=torch.bfloat16,
                prompt_blocks=256, window_blocks=8)
"""Llama-2-7B-shaped blocks (32 layers of 32 KV heads: 8 MiB, every layer of a block one copy, DMA straight from the
cache) and vLLM's window of 128 tokens: the 2 GiB of full-attention blocks copied ahead of the window take about 40 ms
at PCIe 5's 50 GB/s; the host's unchecked steps from the store's submission to the intruder's poison take a few (the
host's cost grows with the blocks, the copy's with their bytes)."""
GPU_PER_LAYER = _scenario("kv-first", layers=32, block_tokens=16, heads=8, head_dim=128, dtype=torch.bfloat16,
                          prompt_blocks=32, window_blocks=8)
"""One tensor per layer, as vLLM registers them (gathered through staging): for the round trip."""

CONTROLS: dict[str, Callable[[HybridRig], None]] = {
    "no-lazy-fence": lambda rig: MUTANTS["no-lazy-fence"].apply(None, rig.connector),  # type: ignore[arg-type]
    "no-slide": lambda rig: setattr(rig.connector.scheduler, "slide", lambda request_id, block_ids: None),
}
"""kvfsm with the window's fence removed: by the spec's mutant, or by an engine that never reports the slide."""
CAUGHT_BY = {"no-lazy-fence": "window-fence", "no-slide": "fence"}
"""The rule each control breaks, which the checks name on any device (they read records and block tables)."""


@dataclass(frozen=True)
class Trial:
    corrupted: dict[str, int]
    """Per group, the reloaded blocks whose bytes differ from what the writer computed."""
    bytes_checked: int
    stored: dict[str, int]
    """Per group, the writer's blocks stored."""
    loaded: dict[str, int]
    """Per group, the reader's blocks loaded."""
    reused: int
    """Blocks a window or state store read that were handed out again while the writer ran."""
    flushed: int
    """Store jobs the steps handing those blocks out flushed (and the worker waited for)."""
    broken: tuple[str, ...] | None
    """The rules the checks found broken during the trial; None where it ran unchecked."""
    null_intact: bool

    @property
    def corrupt(self) -> bool:
        return any(self.corrupted.values())


def trial(rig: HybridRig, scenario: Scenario, seed: int, reuse: bool = True, prefix: str = "") -> Trial:
    """One trial (the module's docstring): the writer of `seed`, an intruder if `reuse`, then the reader (their ids
    after `prefix`)."""
    bs, prompt, window = rig.shape.block_tokens, scenario.prompt_blocks, rig.shape.window_blocks
    writer, intruder, reader = (f"{prefix}{name}{seed}" for name in ("writer", "intruder", "reader"))
    rig.begin()
    rig.add(writer, 2 * seed, prompt, window * bs - 1 if reuse else 0)
    first = rig.step()
    windowed = {b for order in first.stores if order.req_id != writer for b in order.gpu_blocks}
    handed, flushed = set(), 0
    if reuse:
        flushed += len(rig.step({writer: window * bs - 2}).flush)
        handed.update(rig.requests[writer].tables["full"])
        rig.add(intruder, 2 * seed + 1, window)
        flushed += len(rig.step({writer: 1}).flush)
        handed.update(b for table in rig.requests[intruder].tables.values() for b in table)
        rig.finish(intruder)
    rig.finish(writer)
    rig.drain()
    rig.add(reader, 2 * seed, prompt)
    rig.step()
    rig.drain()
    rig.settle()
    corrupted, checked = {}, 0
    for group in rig.groups:
        start = group.first_kept(prompt * bs, bs)
        blocks = rig.requests[reader].tables[group.name][start:prompt]
        corrupted[group.name] = rig.bytes.differing(blocks, rig.content(2 * seed, group)[start:prompt])
        checked += len(blocks) * rig.bytes.caches.gpu_block_bytes
    rig.step({reader: 1})
    rig.finish(reader)
    rig.drain()
    rig.settle()
    null_intact = rig.null_intact()
    rig.forget(2 * seed)
    rig.forget(2 * seed + 1)
    return Trial(corrupted, checked, {g.name: rig.moved[("store", g.tracked(writer))] for g in rig.groups},
                 {g.name: rig.moved[("load", g.tracked(reader))] for g in rig.groups}, len(windowed & handed), flushed,
                 tuple(rig.broken) if rig.checks is not None else None, null_intact)


def new_device(kind: Literal["cuda", "sim"]) -> Device:
    return CudaDevice() if kind == "cuda" else SimDevice()


def trials(kind: Literal["cuda", "sim"], scenario: Scenario, count: int, control: str | None = None,
           reuse: bool = True) -> list[Trial]:
    """`count` trials on one rig (kvfsm, or with `control` applied), each with a prompt of its own; checked except
    the reuse trials on CUDA (the module's docstring)."""
    rig = HybridRig(new_device(kind), scenario.shape, scenario.cpu_blocks, lag_copies=kind == "sim",
                    checked=kind == "sim" or not reuse)
    try:
        if control is not None:
            CONTROLS[control](rig)
        return [trial(rig, scenario, seed, reuse) for seed in range(1, count + 1)]
    finally:
        rig.close()


app = typer.Typer(add_completion=False, help=__doc__)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes >= 2**20 else f"{nbytes:,} B"


def _row(table: Table, name: str, runs: list[Trial]) -> None:
    blocks = {g: sum(t.corrupted[g] for t in runs) for g in runs[0].corrupted}
    broken = sorted({name for t in runs for name in t.broken or ()})
    checked = all(t.broken is not None for t in runs)
    table.add_row(name, str(len(runs)), str(sum(t.corrupt for t in runs)),
                  " / ".join(str(n) for n in blocks.values()), _size(sum(t.bytes_checked for t in runs)),
                  str(sum(t.reused for t in runs)), str(sum(t.flushed for t in runs)),
                  (", ".join(broken) or "-") if checked else "unchecked")


class DeviceChoice(str, Enum):
    auto = "auto"
    cuda = "cuda"
    sim = "sim"


@app.command()
def main(count: int = typer.Option(20, "--trials", min=1, help="trials per arm"),
         device: DeviceChoice = typer.Option(DeviceChoice.auto, help="auto: cuda where torch sees it, else sim")) -> None:
    """Run the round trip once, then `--trials` reuse trials for kvfsm and each control; print one row per arm. Exit
    status 1 when kvfsm corrupted a byte or broke a rule, or a control corrupted nothing."""
    cuda = device == DeviceChoice.cuda or device == DeviceChoice.auto and torch.cuda.is_available()
    kind: Literal["cuda", "sim"] = "cuda" if cuda else "sim"
    scenario = GPU if kind == "cuda" else SIM
    shape = scenario.shape
    started = time.perf_counter()
    arms = {"round trip (kvfsm)": trials(kind, scenario, 1, reuse=False), "kvfsm": trials(kind, scenario, count)}
    arms.update({f"control {name}": trials(kind, scenario, count, name) for name in CONTROLS})
    table = Table(title=f"hybrid cache on {torch.cuda.get_device_name() if kind == 'cuda' else 'SimDevice'}: "
                        f"{shape.layout}, {_size(shape.block_bytes)} blocks, {scenario.prompt_blocks}-block "
                        f"prompt, window {shape.window_blocks} blocks",
                  caption="reused: blocks a window or state store read, handed out while the writer ran; flushed: "
                          "stores the steps handing them out flushed")
    for column in ("arm", "trials", "corrupted trials", "corrupted blocks full/window/state", "bytes checked",
                   "reused", "flushed", "rules broken"):
        table.add_column(column)
    for name, runs in arms.items():
        _row(table, name, runs)
    console = Console(width=140)
    console.print(table)
    console.print(f"{time.perf_counter() - started:.1f} s")
    ours = arms["round trip (kvfsm)"] + arms["kvfsm"]
    if any(t.corrupt or t.broken or not t.null_intact for t in ours) or not all(
            any(t.corrupt for t in arms[f"control {name}"]) for name in CONTROLS):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
