"""What crosses the scheduler/worker boundary each step: pydantic models, so they serialize across processes."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StoreOrder(_Message):
    """Copy `gpu_blocks` into `cpu_slots` (k GPU blocks per slot), behind the compute of the step that ordered it."""

    job_id: int
    req_id: str
    gpu_blocks: tuple[int, ...]
    cpu_slots: tuple[int, ...]


class LoadOrder(_Message):
    """Copy `cpu_slots` into `gpu_blocks`, starting at sub-block `gpu_offset` of the first slot."""

    job_id: int
    req_id: str
    gpu_blocks: tuple[int, ...]
    cpu_slots: tuple[int, ...]
    gpu_offset: int = 0


class TierOrder(_Message):
    """Move whole CPU blocks between `cpu_slots` and the lower tier `tier`, under `keys` (their prefix hashes)."""

    job_id: int
    kind: Literal["write-back", "fetch"]
    tier: str
    keys: tuple[int, ...]
    cpu_slots: tuple[int, ...]


class TierReport(_Message):
    """A tier job this worker saw end; `failed` lists (key, reason) of the blocks that did not move."""

    job_id: int
    failed: tuple[tuple[int, str], ...] = ()
    held: bool = False
    """Final outcome at the tier's deadline, but its I/O may still touch the job's CPU slots."""
    release: bool = False
    """The held job's I/O returned: its CPU slots may be freed."""


class ConnectorMetadata(_Message):
    """One engine step's orders for every worker."""

    step: int
    loads: tuple[LoadOrder, ...] = ()
    stores: tuple[StoreOrder, ...] = ()
    flush: tuple[int, ...] = ()
    """Store jobs to submit now (if still pending) and wait for before the engine reuses any GPU block."""
    tier_orders: tuple[TierOrder, ...] = ()
    """Write-backs and fetches to hand to the lower tiers' I/O threads as the step starts."""


class ScheduledRequest(NamedTuple):
    """A request the engine computes this step, with all its GPU blocks and its computed tokens after the step.

    A typed tuple, not a model: an engine makes one per running request every step, and a model cost 1.5 µs and
    three objects for the garbage collector to make, and a slow attribute to read, per request per step.
    `SchedulerOutput` validates every field of each one when it is built (`model_construct` trusts them)."""

    req_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int


class SchedulerOutput(_Message):
    """The part of an engine's schedule the connector needs to build the step's orders (validated on
    construction, each `ScheduledRequest` with it)."""

    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[str, ...] = ()


class WorkerOutput(_Message):
    """What one worker saw finish since it last reported."""

    worker: int = 0
    done: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    tiers: tuple[TierReport, ...] = ()


class ConnectorOutput(_Message):
    """Every worker's report for one step, as the engine hands it to the scheduler."""

    workers: tuple[WorkerOutput, ...] = Field(default_factory=tuple)
