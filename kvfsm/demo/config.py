"""What the demo is asked to do, and the device and engine that request resolves to.

`DemoConfig` is the one value the command line builds and `run_demo` serves; the model shapes, `resolve_device` and
`engine_config_for` turn it into a concrete device kind and an engine that can admit the workload's longest request.
`kvfsm.tp` serves the same configuration with tensor parallelism, so it reads these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

import torch

from kvfsm.demo.switches import MUTANTS
from kvfsm.engine.engine import EngineConfig
from kvfsm.engine.model import ModelShape
from kvfsm.workload import Arrival, WorkloadShape

SIM_SHAPE = ModelShape(num_layers=2, num_heads=2, head_dim=8, block_size=8)
"""Small enough that a 2-core CPU serves the default workload in seconds."""
CUDA_SHAPE = ModelShape(num_layers=8, num_heads=8, head_dim=128, block_size=8)
"""Same paging as on the CPU (so the same GPU block count means the same pressure); 256 KiB per GPU block."""


class DeviceKind(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Eviction(str, Enum):
    lru = "lru"
    arc = "arc"


class DemoConfigError(ValueError):
    """A demo configuration that cannot serve its workload (a request larger than the GPU cache, no CUDA)."""


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
    writeback: Literal["eager", "on-evict"] = "eager"
    mooncake_master: str | None = None
    """HOST:PORT of a `mooncake_master` for a shared Mooncake tier below the CPU pool (and the disk, if any)."""

    def __post_init__(self) -> None:
        if self.mutant is not None and self.mutant not in MUTANTS:
            raise DemoConfigError(f"unknown mutant {self.mutant!r}; known: {', '.join(sorted(MUTANTS))}")


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
