"""What crosses the scheduler/worker boundary each step: pydantic models, so they serialize across processes."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    moved: bool = True
    """This rank moved the job's bytes. With replicated KV one rank alone does (`REPLICATED_TIER_RANK`); every other
    rank reports the job at once with nothing moved (spec: `replicated-one-tier-move`)."""


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
    """A request the engine computes this step, with all its GPU blocks and its computed tokens after the step:
    one row of a `SchedulerOutput`, which validates its fields."""

    req_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int


class SchedulerOutput(_Message):
    """The part of an engine's schedule the connector needs to build the step's orders.

    Held as columns (request i is `req_ids[i]`, `block_ids[i]`, `num_computed_tokens[i]`), not as a record per
    request: the connector reads every scheduled request every step, and a column is read in C while a record per
    request costs an object to make and an attribute to read, per request per step. An engine that has rows passes
    them as `scheduled=` (validated like the columns); `scheduled` gives them back."""

    req_ids: tuple[str, ...] = ()
    block_ids: tuple[tuple[int, ...], ...] = ()
    """All of each request's GPU blocks."""
    num_computed_tokens: tuple[int, ...] = ()
    """Each request's computed tokens after the step."""
    preempted: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _rows_to_columns(cls, data: Any) -> Any:
        if isinstance(data, dict) and "scheduled" in data:
            data = dict(data)
            rows = tuple(data.pop("scheduled"))
            data["req_ids"], data["block_ids"], data["num_computed_tokens"] = tuple(zip(*rows)) or ((), (), ())
        return data

    @model_validator(mode="after")
    def _columns_align(self) -> "SchedulerOutput":
        if not len(self.req_ids) == len(self.block_ids) == len(self.num_computed_tokens):
            raise ValueError(f"{len(self.req_ids)} req_ids, {len(self.block_ids)} block_ids and "
                             f"{len(self.num_computed_tokens)} num_computed_tokens; one of each per request")
        return self

    @property
    def scheduled(self) -> tuple[ScheduledRequest, ...]:
        """The scheduled requests as rows."""
        return tuple(map(ScheduledRequest, self.req_ids, self.block_ids, self.num_computed_tokens))


class WorkerOutput(_Message):
    """What one worker saw finish since it last reported."""

    worker: int = 0
    done: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    tiers: tuple[TierReport, ...] = ()


class ConnectorOutput(_Message):
    """Every worker's report for one step, as the engine hands it to the scheduler."""

    workers: tuple[WorkerOutput, ...] = Field(default_factory=tuple)
