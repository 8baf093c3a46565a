"""The spec's checks on a run of the adapter under vLLM's Scheduler: the ones kvfsm's own engine gets.

`SpecChecks` records every transition the adapter's machines fire (`TraceRecorder`: each is an edge of the spec and
no state moved behind a machine's back), evaluates kvfsm's named invariants on the adapter's scheduler half after
every step, and, once vLLM and the worker are idle, requires everything drained: no job in flight, no CPU block
pinned or half-written, no GPU block fenced, and every request the connector saw released.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.invariants import Deferral, check_all
from kvfsm.machines import MachineSet
from kvfsm.records import CpuBlock, GpuBlock, RequestRecord, TierJob, TransferJob
from kvfsm.testing.trace import TraceRecorder


class SpecViolation(AssertionError):
    """A run under vLLM broke a rule of the spec: an illegal or hidden transition, a named invariant, or drain."""


class AdapterWorld:
    """kvfsm's `World` seen through the adapter's scheduler half; the worker's device log is not visible here."""

    accesses: Sequence[object] = ()
    tiers: Sequence[object] = ()
    """The adapter refuses lower tiers (their index lives in the worker process), so there are none to read."""

    def __init__(self, scheduler: SchedulerConnector) -> None:
        self._scheduler = scheduler
        self.idle = False

    @property
    def cpu_blocks(self) -> Sequence[CpuBlock]:
        return self._scheduler.manager.blocks

    @property
    def catalogue(self) -> Mapping[int, int]:
        return self._scheduler.manager.catalogue

    @property
    def jobs(self) -> Mapping[int, TransferJob]:
        return self._scheduler.jobs

    @property
    def requests(self) -> Mapping[str, RequestRecord]:
        return self._scheduler.requests

    @property
    def gpu_blocks(self) -> Mapping[int, GpuBlock]:
        return self._scheduler.gpu_blocks

    @property
    def deferrals(self) -> Mapping[str, Deferral]:
        return self._scheduler.deferrals

    @property
    def reported_failed(self) -> set[int]:
        return self._scheduler.reported_failed

    @property
    def tier_jobs(self) -> Mapping[int, TierJob]:
        return self._scheduler.tier_jobs

    @property
    def writeback_bound(self) -> int:
        return self._scheduler.config.writeback_max_bytes_in_flight

    @property
    def num_workers(self) -> int:
        return self._scheduler.config.num_workers


class SpecChecks:
    """Traces the machines from construction on; `after_step` and `after_idle` raise `SpecViolation`."""

    def __init__(self, scheduler: SchedulerConnector, machines: MachineSet) -> None:
        scheduler.ledger.keep_history = True  # ended jobs stay visible: no-convoy and failure-visible read them
        self.world = AdapterWorld(scheduler)
        self.trace = TraceRecorder(machines)

    def violations(self) -> list[str]:
        found = [f"{name}: {line}" for name, lines in check_all(self.world).items() for line in lines]
        return found + [f"trace: {line}" for line in self.trace.check()]

    def after_step(self, step: int) -> None:
        self.world.idle = False
        self._raise(step, self.violations())

    def after_idle(self, step: int) -> None:
        """vLLM has no request left and the worker no job: the adapter must hold nothing either."""
        self.world.idle = True
        found = self.violations()
        found += [f"drained: request {r.req_id} is {r.state}, not released"
                  for r in self.world.requests.values() if r.state != "released"]
        self._raise(step, found)

    def close(self) -> None:
        self.trace.close()

    @staticmethod
    def _raise(step: int, found: list[str]) -> None:
        if found:
            raise SpecViolation(f"step {step}:\n  " + "\n  ".join(found))
