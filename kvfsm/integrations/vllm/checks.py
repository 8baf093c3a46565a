"""The spec's checks on a run of the adapter under vLLM's Scheduler: the ones kvfsm's own engine gets.

`SpecChecks` is `kvfsm.checking.RunChecks` on the adapter's scheduler half: every transition its machines fire is
traced against the spec, kvfsm's named invariants are evaluated after every step and, once vLLM and the worker are
idle, everything must have drained: no job in flight, no CPU block pinned or half-written, no GPU block fenced, and
every request the connector saw released. The lower tiers checked are the scheduler's indexes of them
(`tier_index.ReportedTier`: their `tier-entry` records and the fetches each has in flight), beside every write-back
and fetch the scheduler ordered; the tiers' own records and the worker's device log live in the worker processes,
out of sight here. An index adopts what the workers wrote, so `publish-after-write` is read there across processes
too (`reported_publish_after_write`): a key the index offers was written back on every rank.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvfsm.checking import ConnectorWorld, InvariantViolation, RunChecks
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.integrations.vllm.tier_index import ReportedTier
from kvfsm.machines import MachineSet
from kvfsm.states import TierEntryState, TierJobState


class SpecViolation(InvariantViolation):
    """A run under vLLM broke a rule of the spec: an illegal or hidden transition, a named invariant, or drain."""


def reported_publish_after_write(world: SchedulerWorld) -> list[str]:
    """`publish-after-write` for the scheduler's indexes: every key an index publishes (or a fetch reads) was carried
    by a write-back of that tier that every rank reported done (or failed for other keys only), or was shown complete
    for every rank by the tier's shared store (its master or directory). An index that offered a key earlier would
    order a fetch of bytes some rank has not written (read with `keep_history`, as every check)."""
    landed = {(job.tier, key) for job in world.tier_jobs.values() if job.kind == "write-back"
              and (job.state == TierJobState.DONE or job.state == TierJobState.FAILED)
              for key in job.keys if key not in job.failed_keys}
    return [f"{tier.name}: key {entry.key:#x} is {entry.state} in the scheduler's index, but no write-back of it "
            "ended on every rank" for tier in world.tiers for entry in tier.entries
            if entry.state in (TierEntryState.PUBLISHED, TierEntryState.READING)
            and (tier.name, entry.key) not in landed and entry.key not in tier.shown]


class SchedulerWorld(ConnectorWorld):
    """The scheduler half's records and the lower tiers as the scheduler process indexes them."""

    def __init__(self, scheduler: SchedulerConnector, is_idle: Callable[[], bool],
                 tiers: Sequence[ReportedTier]) -> None:
        super().__init__(scheduler, is_idle)
        self._tiers = tuple(tiers)

    @property
    def tiers(self) -> Sequence[ReportedTier]:
        return self._tiers


class SpecChecks(RunChecks):
    """Traces the machines from construction on; `after_step` and `after_idle` raise `SpecViolation`."""

    def __init__(self, scheduler: SchedulerConnector, machines: MachineSet,
                 tiers: Sequence[ReportedTier] = ()) -> None:
        """`tiers`: the scheduler side's indexes of the lower tiers (`SchedulerSide.tier_index.tiers`)."""
        self.idle = False
        """Whether vLLM has no request left and the worker no job: only the caller knows."""
        super().__init__(SchedulerWorld(scheduler, lambda: self.idle, tiers), machines, SpecViolation)

    def violations(self) -> dict[str, list[str]]:
        found = super().violations()
        if reported := reported_publish_after_write(self.world):  # type: ignore[arg-type]
            found["publish-after-write"] = found.get("publish-after-write", []) + reported
        return found

    def after_step(self, step: int) -> None:
        self.idle = False
        super().after_step(step)

    def after_idle(self, step: int) -> None:
        """vLLM has no request left and the worker no job: the adapter must hold nothing either."""
        self.idle = True
        super().after_step(step)
