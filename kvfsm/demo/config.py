"""What the demo is asked to do: `DemoConfig`, the one value the command line builds and `run_demo` serves.

Nothing here imports torch or the engine: the command line reads these defaults for its `--help`, which must not
wait for torch. What a configuration resolves to (a device, model shapes, an engine, kvfsm's own configuration) is
`kvfsm.demo.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import get_args

from kvfsm.config import EvictionName, WriteBack
from kvfsm.workload import WorkloadShape

GPU_BLOCK_TOKENS = 8
"""Tokens per GPU block, on the simulator and on CUDA alike, so the same GPU block count means the same pressure."""


class DeviceKind(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


Eviction = Enum("Eviction", {n.replace("-", "_"): n for n in get_args(EvictionName)}, type=str)  # type: ignore[misc]
"""The built-in eviction policies, one per `kvfsm.config.EvictionName` (so the demo offers every built-in)."""


class DemoConfigError(ValueError):
    """A demo configuration that cannot serve its workload (a request larger than the GPU cache, no CUDA, a CPU
    block longer than every request); `option`, where known, is the command-line option to change."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


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
    """Serve with one of `kvfsm.demo.switches.MUTANTS` (a guarded rule removed), to see the check catch it."""
    disk: Path | None = None
    """A directory for a disk tier below the CPU pool (None: no disk tier)."""
    disk_blocks: int = 4096
    writeback: WriteBack = "eager"
    mooncake_master: str | None = None
    """HOST:PORT of a `mooncake_master` for a shared Mooncake tier below the CPU pool (and the disk, if any)."""

    def __post_init__(self) -> None:
        if self.mutant is not None:
            from kvfsm.demo.switches import MUTANTS  # the controls patch the connector: they bring torch

            if self.mutant not in MUTANTS:
                raise DemoConfigError(f"unknown mutant {self.mutant!r}; known: {', '.join(sorted(MUTANTS))}",
                                      option="--mutant")
