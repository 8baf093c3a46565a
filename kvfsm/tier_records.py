"""The models the lower tiers' lifecycles move (`tier-entry`, `tier-job`), and the guards and effects `spec/` names
for them.

The same contract as `kvfsm.records` (a record's `state` changes only through `kvfsm.machines`, its other fields
only through the effects bound here), kept apart because the lower tiers are a layer of their own: a tier
(`kvfsm.tiers`) and its index know these two records and none of the connector's blocks, jobs or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvfsm.registry import REGISTRY

TierJobKind = Literal["write-back", "fetch"]
IN_FLIGHT_TIER_JOB_STATES = frozenset({"created", "submitted", "abandoned"})  # its I/O may still run


@dataclass(slots=True, eq=False)
class TierEntry:
    """One key of one lower tier; `slot` is where a slotted tier keeps its bytes, None for a keyed store (a disk's
    file per block, Mooncake's object)."""

    key: int
    slot: int | None = None
    state: str = "empty"
    checksum: int | None = None
    adopted: bool = False
    """Published by another process in a shared store: its checksum is sealed inside the stored value."""


@dataclass(slots=True, eq=False)
class TierJob:
    """One write-back or fetch between the CPU pool and the lower tier `tier`: which keys, which CPU slots."""

    job_id: int
    kind: TierJobKind
    tier: str
    keys: tuple[int, ...]
    cpu_slots: tuple[int, ...]
    block_bytes: int
    ordered_step: int = 0
    state: str = "created"
    finished_step: int | None = None
    failed_keys: tuple[int, ...] = ()
    reports: dict[int, Any] = field(default_factory=dict)
    """Each rank's `TierReport` of its end, logged by the scheduler until every rank reported (empty elsewhere)."""
    released: set[int] = field(default_factory=set)
    """Ranks that reported it held at its deadline and since released it: their I/O for it returned."""

    @property
    def in_flight(self) -> bool:
        return self.state in IN_FLIGHT_TIER_JOB_STATES

    @property
    def holding(self) -> set[int]:
        """Ranks whose I/O for it may still touch its CPU slots: they reported it held and have not released it."""
        return {rank for rank, report in self.reports.items() if report.held} - self.released

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_bytes


# tier-entry ------------------------------------------------------------------------------------------------


@REGISTRY.effect("tier-entry", "record-checksum")
def _record_checksum(entry: TierEntry, checksum: int | None = None, **_: object) -> None:
    entry.checksum = checksum


@REGISTRY.effect("tier-entry", "mark-adopted")
def _mark_adopted(entry: TierEntry, **_: object) -> None:
    entry.adopted = True


@REGISTRY.effect("tier-entry", "forget-checksum")
def _forget_checksum(entry: TierEntry, **_: object) -> None:
    entry.checksum = None


# tier-job --------------------------------------------------------------------------------------------------


@REGISTRY.effect("tier-job", "record-tier-finish-step")
def _record_tier_finish_step(job: TierJob, step: int | None = None, **_: object) -> None:
    job.finished_step = step


# couplings of tier-job: selectors by the job's kind, so one transition serves both kinds and a write-back's end never
# names a fetch's trigger (nor the reverse)


@REGISTRY.relation("tier-job", "write-back-slots")
def _write_back_slots(job: TierJob) -> tuple[int, ...]:
    return job.cpu_slots if job.kind == "write-back" else ()


@REGISTRY.relation("tier-job", "fetch-slots")
def _fetch_slots(job: TierJob) -> tuple[int, ...]:
    return job.cpu_slots if job.kind == "fetch" else ()


@REGISTRY.relation("tier-job", "landed-fetch-slots")
def _landed_fetch_slots(job: TierJob) -> tuple[int, ...]:
    """A failed fetch's slots whose keys it read and verified: their bytes are good, they become loadable."""
    lost = set(job.failed_keys)
    return tuple(s for k, s in zip(job.keys, _fetch_slots(job)) if k not in lost)


@REGISTRY.relation("tier-job", "lost-fetch-slots")
def _lost_fetch_slots(job: TierJob) -> tuple[int, ...]:
    """A failed fetch's slots whose keys it lost (`failed_keys`): freed and forgotten, so a lookup misses them."""
    lost = set(job.failed_keys)
    return tuple(s for k, s in zip(job.keys, _fetch_slots(job)) if k in lost)
