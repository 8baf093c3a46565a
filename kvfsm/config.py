"""What a user sets, validated at start-up: a bad key or value is a clear error before any memory is pinned."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

Mechanism = Literal["auto", "copy-per-block", "staged-gather", "cross-layer", "staged-copy"]


class PoolTooSmall(ValueError):
    """`cpu_bytes` does not hold one CPU block of the registered KV cache."""


class OffloadConfig(BaseModel):
    """kvfsm's configuration; also what vLLM's `kv_connector_extra_config` is validated against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_blocks: PositiveInt | None = None
    """Size of the pinned host pool in CPU blocks; give this or `cpu_bytes`."""
    cpu_bytes: PositiveInt | None = None
    """Size of the pinned host pool in bytes (rounded down to whole CPU blocks); give this or `cpu_blocks`."""
    block_size_factor: PositiveInt = 1
    """A CPU block holds this many consecutive GPU blocks (bigger copies, coarser hits)."""
    gpu_block_size: PositiveInt = 16
    """Tokens per GPU block, as the engine pages its KV cache."""
    eviction: Literal["lru", "arc"] = "lru"
    mechanism: Mechanism = "auto"
    num_workers: PositiveInt = 1
    """A job completes when this many workers (tensor-parallel ranks) reported it."""
    layer_loads: bool = False
    """With an engine that calls `wait_for_layer_load` before each layer reads KV: a CPU hit is computed in the step
    that loads it (the lookup says the load is not asynchronous), each layer waiting on the GPU for its own
    segment of the load. Off: the engine computes a hit once its load is reported, as without per-layer hooks."""
    layer_stores: bool = False
    """With an engine that calls `save_kv_layer`: start each layer's stores as soon as that layer's KV is written,
    instead of at the start of the next step. Off by default: on an H100 the sampled-token copy then waited
    0.65 ms behind the last layer's store, against 0.01 ms with deferred stores (docs/benchmarks.md)."""
    checksum: bool = False
    """Checksum each CPU block when its store completes and verify it before loading it; a mismatch fails the
    load loudly (the engine recomputes) instead of loading corrupted KV. Costs a host CRC pass per block."""

    @model_validator(mode="after")
    def _one_pool_size(self) -> "OffloadConfig":
        if (self.cpu_blocks is None) == (self.cpu_bytes is None):
            raise ValueError("give exactly one of cpu_blocks and cpu_bytes")
        return self

    @property
    def cpu_block_tokens(self) -> int:
        return self.gpu_block_size * self.block_size_factor

    def num_cpu_blocks(self, gpu_block_bytes: int) -> int:
        """Pool size in CPU blocks, given the bytes one GPU block occupies across all layers."""
        if self.cpu_blocks is not None:
            return self.cpu_blocks
        assert self.cpu_bytes is not None  # the validator demands cpu_blocks or cpu_bytes
        blocks = self.cpu_bytes // (gpu_block_bytes * self.block_size_factor)
        if blocks == 0:
            raise PoolTooSmall(
                f"cpu_bytes={self.cpu_bytes} holds no CPU block of {gpu_block_bytes * self.block_size_factor} bytes; "
                f"legal: at least {gpu_block_bytes * self.block_size_factor}"
            )
        return blocks
