"""What a user sets, validated at start-up: a bad key or value is a clear error before any memory is pinned.

Validation is strict (pydantic's strict mode): a value of the wrong type is refused rather than coerced, so
`cpu_blocks=True` is not 1 and `layer_loads="yes"` is not on. Two coercions stay, because they lose nothing and
a dictionary read from JSON (vLLM's `kv_connector_extra_config`) needs them: a list where a tuple of tiers is
expected, and a string where a path is. An int is a valid float (`io_timeout_s=30`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

Mechanism = Literal["auto", "copy-per-block", "staged-gather", "fused-gather", "cross-layer", "staged-copy"]
WriteBack = Literal["eager", "on-evict"]
"""eager: a block is written back as soon as its store completed. on-evict: the blocks next in line for CPU
eviction are written back before they are evicted, so the tier receives what the CPU pool is about to lose."""
AdmissionRule = Literal["every-block", "prompt-only"]
"""every-block: each completed block is offered to the pool. prompt-only: only blocks made wholly of prompt tokens (the
tokens a request holds at its first lookup) are; decode blocks are skipped, as vLLM's `offload_prompt_only` does."""


ThresholdScope = Literal["every-block", "cold-prefix"]
"""Which blocks `store_threshold` counts. every-block: each block the pool does not hold. cold-prefix: only a block
that starts a prefix the pool does not hold (the request's first block, or one after a block neither held nor
admitted); a block extending a held or admitted prefix is stored at its first offer."""


EvictionName = Literal["lru", "arc", "s3-fifo", "s3-fifo-adaptive", "tinylfu", "w-tinylfu"]
"""The built-in eviction policies (`kvfsm.manager.policies`); `tinylfu` and `w-tinylfu` name the same one."""
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


QUEUE_BOUND_WITHOUT_QUEUE = "queue_bound_without_queue"
"""The pydantic error type of a `writeback_max_queued_blocks` given to an on-evict tier."""


_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True)
"""Every config model: unknown keys refused, immutable once built, no type coercion."""


CPU_TIER = "cpu"
"""The CPU pool's name where tiers are named side by side (`kvfsm_hit_blocks_total{tier=...}`): no lower tier's."""


class _TierConfig(BaseModel):
    model_config = _STRICT

    name: str = Field(default="", pattern=r"^[a-z0-9-]*$")
    """Unique among the tiers; defaults to `kind`."""
    writeback: WriteBack = "on-evict"
    evict_lookahead_blocks: PositiveInt = 32
    """on-evict: how many of the CPU pool's next eviction victims are kept written back to this tier."""
    writeback_max_queued_blocks: PositiveInt | None = None
    """eager: most stored blocks waiting for their write-back to this tier. A block stored while the queue is full
    is shed for this tier (`stores-bounded`): never written back to it (a later miss there), counted in
    `kvfsm_store_shed_total{tier=...}`. None: the queue is bounded by the CPU pool alone, so a saturated tier keeps
    up to a pool's worth of stale work queued and every step walks it. An on-evict tier has no queue (it writes back
    the pool's next `evict_lookahead_blocks` victims) and refuses the bound by name."""

    @model_validator(mode="after")
    def _queue_bound_needs_queue(self) -> "_TierConfig":
        if self.writeback_max_queued_blocks is not None and self.writeback != "eager":
            raise PydanticCustomError(
                QUEUE_BOUND_WITHOUT_QUEUE, "tier {tier}: writeback_max_queued_blocks bounds an eager tier's queue; "
                "an on-evict tier has none (its evict_lookahead_blocks bounds its work)", {"tier": self.tier_name})
        return self

    @property
    def tier_name(self) -> str:
        return self.name or self.kind  # type: ignore[attr-defined]


class DiskTierConfig(_TierConfig):
    """A local disk below the CPU pool: one file per block in `path`. With `model_id` and `kv_dtype` the blocks
    outlive the engine and are shared by every engine of that model on the host that names the same `path`;
    without them the tier is private to the process and starts empty (see docs/tiers.md)."""

    kind: Literal["disk"] = "disk"
    path: Path = Field(strict=False)
    """A directory (created if absent); kvfsm owns the directories named `kvfsm2-*` and `private-*` in it."""
    capacity_bytes: PositiveInt
    """Most bytes of blocks one worker keeps, rounded down to whole CPU blocks (each file adds a 72-byte record)."""
    model_id: str | None = Field(default=None, min_length=1)
    """The model and revision whose KV this engine computes: names the shared directory, so models never share KV.
    Give it with `kv_dtype` to keep the blocks across restarts and share them; leave both out for a private tier."""
    kv_dtype: str | None = Field(default=None, min_length=1)
    """Element type of the KV cache (`bfloat16`, ...): part of the shared directory's name, as `model_id` is."""
    io_threads: PositiveInt = 4
    """Threads doing this tier's reads and writes, off the engine's thread."""
    io_timeout_s: PositiveFloat = 30.0
    """A job whose I/O has not returned after this long is reported failed (the engine recomputes); its CPU
    slots stay held until the I/O really returns."""
    lookup_timeout_s: PositiveFloat = 0.05
    """A shared tier: longest a lookup holds the scheduling step waiting for the disk to say which blocks other
    engines wrote (in process, the tier's own `stat`s; under vLLM, the scheduler process's); late is a miss."""

    @field_validator("path")
    @classmethod
    def _a_directory(cls, path: Path) -> Path:
        if path.exists() and not path.is_dir():
            raise ValueError(f"disk tier path {path} exists and is not a directory")
        return path

    @model_validator(mode="after")
    def _shared_names_both(self) -> DiskTierConfig:
        if (self.model_id is None) != (self.kv_dtype is None):
            raise ValueError("a shared disk tier names both model_id and kv_dtype (a private one names neither)")
        return self

    @property
    def shared(self) -> bool:
        """Whether the blocks outlive the engine and are shared by engines of the same model on the host."""
        return self.model_id is not None


class MooncakeTierConfig(_TierConfig):
    """A shared tier on Mooncake Store: engines that name the same master, model and KV layout reuse each other's
    prefixes. Needs the `mooncake` extra (`pip install 'kvfsm[mooncake]'`); see docs/mooncake.md."""

    kind: Literal["mooncake"] = "mooncake"
    master: str = Field(pattern=r"^[^\s:]+:[0-9]{1,5}$")
    """The `mooncake_master` RPC address, HOST:PORT."""
    model_id: str = Field(min_length=1)
    """The model and revision whose KV this engine computes: part of every key, so models never share KV."""
    kv_dtype: str = Field(min_length=1)
    """Element type of the KV cache (`bfloat16`, ...): part of every key."""
    tenant: str | None = None
    """A salt mixed into every key (as vLLM's `cache_salt`): engines with different tenants never share KV. Not a
    secret: anyone who can reach the master may know it (docs/security.md)."""
    kv_heads: PositiveInt | None = None
    """The model's KV heads, all ranks together. Given, a block is stored as one value per KV head, keyed without
    the tensor-parallel rank or size, so engines of every TP size of the model share prefixes
    (`kvfsm.mooncake.heads`; layouts `kv-first` and `blocks-first`). Left out, a rank stores its whole CPU block
    under a key that names its rank and TP size: only engines of the same TP size share."""
    secret_file: Path | None = Field(default=None, strict=False)
    """A file holding the tenant's secret (at least 32 bytes; surrounding whitespace ignored): every value is
    sealed and checked with a MAC keyed from it, so values written by anyone without it are refused. Read once,
    when the tier opens. None: the secret is read from the environment variable `secret_env`."""
    secret_env: str = Field(default="KVFSM_MOONCAKE_SECRET", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The environment variable holding the tenant's secret when `secret_file` is None."""
    hash_threads: PositiveInt | None = None
    """Threads that seal and check the values' MACs, overlapped with the transfers. None: half the cores the
    worker may run on, 2 to 8."""
    segment_bytes: int = Field(default=0, ge=0)
    """Memory this engine lends to the store; 0 leaves storage to segment hosts (the shared KV outlives engines)."""
    op_timeout_s: float = Field(default=2.0, gt=0)
    """A call still queued this long is cancelled; one already running is held until it returns."""
    lookup_timeout_s: float = Field(default=0.05, gt=0)
    """Longest a lookup waits for the store's answer on the scheduler's thread; a late answer counts as a miss."""
    retry_after_s: float = Field(default=1.0, gt=0)
    """After the store was unreachable or slow, calls are refused at once (misses) for this long."""
    max_pending: PositiveInt = 32
    """Calls queued or running beyond this are refused at once (the write-back or fetch fails, nothing waits)."""
    index_keys: PositiveInt = 65536
    """Published keys this engine remembers of the store (written here or adopted by a lookup); the least recently
    used beyond it is forgotten here (the store keeps it, and a later lookup adopts it again), so the index stays
    bounded however many prefixes pass through a shared store."""


LowerTierConfig = Annotated[Union[DiskTierConfig, MooncakeTierConfig], Field(discriminator="kind")]
"""Every kind of lower tier kvfsm knows; a new tier adds its config class here and a factory in `kvfsm.tiers`."""


class PoolTooSmall(ValueError):
    """`cpu_bytes` does not hold one CPU block of the registered KV cache."""


class OffloadConfig(BaseModel):
    """kvfsm's configuration; also what vLLM's `kv_connector_extra_config` is validated against."""

    model_config = _STRICT

    cpu_blocks: PositiveInt | None = None
    """Size of the pinned host pool in CPU blocks; give this or `cpu_bytes`."""
    cpu_bytes: PositiveInt | None = None
    """Size of the pinned host pool in bytes (rounded down to whole CPU blocks); give this or `cpu_blocks`."""
    block_size_factor: PositiveInt = 1
    """A CPU block holds this many consecutive GPU blocks (bigger copies, coarser hits)."""
    gpu_block_size: PositiveInt = 16
    """Tokens per GPU block, as the engine pages its KV cache."""
    eviction: str = "lru"
    """A built-in policy's name (`EvictionName`) or a user's policy as `package.module:ClassName`; the connector
    imports and checks a path when it starts (`kvfsm.manager.policies.factory`)."""
    admission: AdmissionRule = "every-block"
    """Which completed blocks are offered for storing; the others are skipped (`skip-store`, counted by reason)."""
    store_threshold: PositiveInt = 1
    """A block the pool does not hold is stored only from its `store_threshold`-th offer on (each request offers a
    block once); earlier offers are skipped. 1 stores at the first offer. Like vLLM's `store_threshold`."""
    store_threshold_scope: ThresholdScope = "every-block"
    """Which blocks `store_threshold` counts (`ThresholdScope`): `cold-prefix` spares a conversation's next turn,
    which extends a prefix already stored, and still skips a one-off document, whose first block nobody stored."""
    store_offers_tracked: PositiveInt = 65536
    """With `store_threshold` above 1: how many blocks' offer counts are kept (least recently offered forgotten
    first), so the counts stay bounded however many distinct blocks pass."""
    mechanism: Mechanism = "auto"
    staging_bytes: PositiveInt | None = None
    """Size of each device staging slot of the gathering mechanisms (two per direction): a step's stores go out as
    a pipeline of chunks of this size, so the copy engine moves one chunk while the next is gathered. None: 128 MiB,
    capped at the cache's size."""
    num_workers: PositiveInt = 1
    """A job completes when this many workers (tensor-parallel ranks) reported it."""
    replicated: bool = False
    """Every rank holds the same KV (MLA: the latent is not split by heads): the ranks of a host share one host
    pool (`kvfsm.executor.shared_host`), each store is copied by one rank, its writer (`store_writer`), and every
    rank loads from the shared slot. One copy of the bytes crosses PCIe and sits in host memory instead of one per
    rank (spec: `replicated-single-writer`). With lower tiers, one rank moves every write-back and fetch between the
    shared pool and a tier (`REPLICATED_TIER_RANK`, spec: `replicated-one-tier-move`); with `checksum`, a block's
    checksum is taken by the rank that copied it, into a table the ranks share."""
    layer_loads: bool = False
    """With an engine that calls `wait_for_layer_load` before each layer reads KV: a CPU hit is computed in the step
    that loads it (the lookup says the load is not asynchronous), each layer waiting on the GPU for its own
    segment of the load. Off: the engine computes a hit once its load is reported, as without per-layer hooks."""
    async_scheduling: bool = False
    """The engine schedules step N+1 before it has read step N's output (vLLM's async scheduling, its default).
    `layer_loads` then loads CPU hits asynchronously: a failed load computed in its own step would reach the engine
    only after the next step, already scheduled, computed on the blocks that did not land
    (`no-inline-load-under-async-scheduling`)."""
    layer_stores: bool = False
    """With an engine that calls `save_kv_layer`: start each layer's stores as soon as that layer's KV is written,
    instead of at the start of the next step. Off by default: on an H100 the sampled-token copy then waited
    0.65 ms behind the last layer's store, against 0.01 ms with deferred stores (docs/benchmarks.md)."""
    checksum: bool = False
    """Checksum each CPU block when its store completes and verify it before loading it; a mismatch fails the
    load loudly (the engine recomputes) instead of loading corrupted KV. Costs a host CRC pass per block."""
    lower_tiers: tuple[LowerTierConfig, ...] = Field(default=(), strict=False)
    """Stores below the CPU pool, looked up in this order after it; CPU blocks are written back to each."""
    writeback_max_bytes_in_flight: PositiveInt = 256 * 1024 * 1024
    """Bound on the bytes of write-backs submitted and not yet finished, across all lower tiers."""
    store_max_blocks_in_flight: PositiveInt | None = None
    """Back-pressure on GPU-to-CPU stores: most CPU blocks of stores ordered and not yet reported done or failed.
    A block a request completes while the bound is reached is shed (`stores-bounded`): its request's `skip-store`
    with reason `shed`, never stored (a later lookup misses it and recomputes), counted in
    `kvfsm_store_shed_total{tier="cpu"}`. Stores that fall behind (copy engines saturated) then stop piling up on
    the copy stream ahead of the loads that queue behind them. None: bounded by the CPU pool alone."""
    kv_events: bool = False
    """Record a `BlockStored` / `BlockRemoved` event each time CPU blocks become loadable or stop being so, for an
    engine that publishes which prefixes the host pool serves and drains them every step (`take_events()`). Off
    by default: an engine that never drains them would hold an ever-growing list."""

    @field_validator("eviction")
    @classmethod
    def _a_policy(cls, eviction: str) -> str:
        if eviction not in get_args(EvictionName) and not _IMPORT_PATH.match(eviction):
            raise ValueError(f"unknown eviction policy {eviction!r}; legal: one of {', '.join(get_args(EvictionName))}"
                             " or an import path package.module:ClassName")
        return eviction

    @model_validator(mode="after")
    def _one_pool_size(self) -> "OffloadConfig":
        if (self.cpu_blocks is None) == (self.cpu_bytes is None):
            raise ValueError("give exactly one of cpu_blocks and cpu_bytes")
        names = [tier.tier_name for tier in self.lower_tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"lower tier names must be unique, got {names}")
        if CPU_TIER in names:
            raise ValueError(f"a lower tier may not be named {CPU_TIER!r}: metrics and KV events name the CPU pool so")
        return self

    @property
    def inline_loads(self) -> bool:
        """Whether a CPU hit is computed in the step that loads it: `layer_loads`, unless the engine schedules ahead."""
        return self.layer_loads and not self.async_scheduling

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


REPLICATED_TIER_RANK = 0
"""With replicated KV: the one rank that moves the bytes of every tier job (spec: `replicated-one-tier-move`); the
other ranks open no lower tier. Rank 0, because the scheduler half looks its tiers up there (a private disk tier's
index is its own process's), and a tier job moves host memory to a disk or the network, over no rank's own PCIe
link, so spreading tier jobs over the ranks, as stores are spread, would buy no link bandwidth."""


def moves_tier_jobs(config: OffloadConfig, worker: int) -> bool:
    """Whether rank `worker` moves tier jobs' bytes: every rank its own share without replicated KV, one rank with."""
    return not config.replicated or worker == REPLICATED_TIER_RANK


def store_writer(job_id: int, num_workers: int) -> int:
    """The rank that copies a replicated store (`OffloadConfig.replicated`): stores take turns over the ranks, so
    each rank's PCIe link carries its share of the one copy (spec: `replicated-single-writer`)."""
    return job_id % num_workers
