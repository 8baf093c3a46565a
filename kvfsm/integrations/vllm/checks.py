"""The spec's checks on a run of the adapter under vLLM's Scheduler: the ones kvfsm's own engine gets.

`SpecChecks` is `kvfsm.checking.RunChecks` on the adapter's scheduler half: every transition its machines fire is
traced against the spec, kvfsm's named invariants are evaluated after every step and, once vLLM and the worker are
idle, everything must have drained: no job in flight, no CPU block pinned or half-written, no GPU block fenced, and
every request the connector saw released. The worker's device log lives in the worker process, out of sight here.
"""

from __future__ import annotations

from kvfsm.checking import ConnectorWorld, InvariantViolation, RunChecks
from kvfsm.connector.scheduler import SchedulerConnector
from kvfsm.machines import MachineSet


class SpecViolation(InvariantViolation):
    """A run under vLLM broke a rule of the spec: an illegal or hidden transition, a named invariant, or drain."""


class SpecChecks(RunChecks):
    """Traces the machines from construction on; `after_step` and `after_idle` raise `SpecViolation`."""

    def __init__(self, scheduler: SchedulerConnector, machines: MachineSet) -> None:
        self.idle = False
        """Whether vLLM has no request left and the worker no job: only the caller knows."""
        super().__init__(ConnectorWorld(scheduler, lambda: self.idle), machines, SpecViolation)

    def after_step(self, step: int) -> None:
        self.idle = False
        super().after_step(step)

    def after_idle(self, step: int) -> None:
        """vLLM has no request left and the worker no job: the adapter must hold nothing either."""
        self.idle = True
        super().after_step(step)
