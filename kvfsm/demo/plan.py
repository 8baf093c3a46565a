"""What a `DemoConfig` resolves to (device, model shape, arrivals, engine, kvfsm's configuration), all checked
before either run starts.

A configuration that cannot run is refused here, naming the option to change, rather than after the run without
offloading has already taken its minutes: a request larger than the GPU cache, CUDA asked for and absent, a CPU
block longer than every request (nothing could ever be stored), a lower tier pydantic refuses, a Mooncake master
that is not there. `kvfsm.tp` serves the same configuration with tensor parallelism, so it reads these too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfsm.config import DiskTierConfig, LowerTierConfig, MooncakeTierConfig, OffloadConfig
from kvfsm.demo.config import GPU_BLOCK_TOKENS, DemoConfig, DemoConfigError, DeviceKind
from kvfsm.engine.config import EngineConfig
from kvfsm.engine.model import ModelShape
from kvfsm.mooncake import available as mooncake_available
from kvfsm.mooncake.local import MasterAddress, port_accepts
from kvfsm.workload import Arrival, generate

SIM_SHAPE = ModelShape(num_layers=2, num_heads=2, head_dim=8, block_size=GPU_BLOCK_TOKENS)
"""Small enough that a 2-core CPU serves the default workload in seconds."""
CUDA_SHAPE = ModelShape(num_layers=8, num_heads=8, head_dim=128, block_size=GPU_BLOCK_TOKENS)
"""Same paging as on the CPU (so the same GPU block count means the same pressure); 256 KiB per GPU block."""


def resolve_device(kind: DeviceKind) -> DeviceKind:
    """`auto` is CUDA when torch sees a GPU, else the CPU simulator; asking for absent CUDA is an error."""
    if kind is DeviceKind.auto:
        return DeviceKind.cuda if torch.cuda.is_available() else DeviceKind.cpu
    if kind is DeviceKind.cuda and not torch.cuda.is_available():
        raise DemoConfigError("cuda was asked for, but torch sees no CUDA device", option="--device")
    return kind


def engine_config_for(arrivals: list[Arrival], gpu_blocks: int, shape: ModelShape) -> EngineConfig:
    """The engine admits a request only whole, so the batch budget and the GPU cache must fit the longest one."""
    longest = max(len(a.prompt) + a.max_new_tokens for a in arrivals)
    needed = -(-longest // shape.block_size)
    if needed > gpu_blocks:
        raise DemoConfigError(f"the longest request needs {needed} GPU blocks of {shape.block_size} tokens; "
                              f"--gpu-blocks is {gpu_blocks}", option="--gpu-blocks")
    return EngineConfig(num_gpu_blocks=gpu_blocks, max_batched_tokens=2 * longest, model=shape)


def offload_config(config: DemoConfig, shape: ModelShape) -> OffloadConfig:
    """kvfsm's configuration for the run with offloading; pydantic's `ValidationError` names the field it refuses."""
    block_bytes = config.block_size_factor * shape.gpu_block_bytes
    tiers: tuple[LowerTierConfig, ...] = (DiskTierConfig(
        path=config.disk, capacity_bytes=config.disk_blocks * block_bytes, writeback=config.writeback),
    ) if config.disk is not None else ()
    if config.mooncake_master is not None:
        tiers += (MooncakeTierConfig(master=config.mooncake_master, model_id="kvfsm-demo-toy",
                                     kv_dtype=str(shape.dtype), writeback=config.writeback),)
    return OffloadConfig(cpu_blocks=config.cpu_blocks, block_size_factor=config.block_size_factor,
                         gpu_block_size=shape.block_size, eviction=config.eviction.value, lower_tiers=tiers)


def _some_request_fills_a_cpu_block(arrivals: list[Arrival], offload: OffloadConfig) -> None:
    """Only a full CPU block is stored: one longer than every request never fills, and the run would store
    nothing yet pass, having checked no offloading at all."""
    longest = max(len(a.prompt) + a.max_new_tokens for a in arrivals)
    if offload.cpu_block_tokens > longest:
        raise DemoConfigError(f"a CPU block of {offload.cpu_block_tokens} tokens ({offload.block_size_factor} GPU "
                              f"blocks) is longer than the workload's longest request ({longest} tokens): nothing "
                              "could ever be stored", option="--block-size-factor")


def _mooncake_master_answers(master: str | None) -> None:
    """A master that is absent (or a Mooncake not installed) would fail the run with kvfsm only after the run
    without offloading; `offload_config` has already checked the address is HOST:PORT."""
    if master is None:
        return
    if not mooncake_available():
        raise DemoConfigError("Mooncake is not installed (pip install 'kvfsm[mooncake]')", option="--mooncake-master")
    address = MasterAddress.parse(master)
    if not port_accepts(address.host, address.port):
        raise DemoConfigError(f"nothing accepts connections at {address}", option="--mooncake-master")


@dataclass(frozen=True)
class DemoPlan:
    """A configuration resolved and checked: what both runs serve."""

    config: DemoConfig
    kind: DeviceKind
    arrivals: list[Arrival]
    engine: EngineConfig


def plan_demo(config: DemoConfig) -> DemoPlan:
    """Resolve `config` and check it can run; raises `DemoConfigError` (or pydantic's `ValidationError`) before
    any work starts."""
    kind = resolve_device(config.device)
    shape = SIM_SHAPE if kind is DeviceKind.cpu else CUDA_SHAPE
    arrivals = generate(config.workload, shape.vocab, config.seed)
    engine = engine_config_for(arrivals, config.gpu_blocks, shape)
    _some_request_fills_a_cpu_block(arrivals, offload_config(config, shape))
    _mooncake_master_answers(config.mooncake_master)
    return DemoPlan(config, kind, arrivals, engine)
