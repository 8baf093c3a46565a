"""The spec's checks on a running integration, after every step: what kvfsm's own engine gets, for any engine.

`RunChecks` records every transition the connector's machines fire (`TraceRecorder`: each is an edge of the spec
and no state moved behind a machine's back), evaluates kvfsm's named invariants on a `ConnectorWorld` after every
step and, once the world is idle, also requires every request the connector saw released. A violation raises
`InvariantViolation`, which names each broken invariant, so a caller can tell a fence from a leak without parsing.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from kvfsm.checking.trace import TraceRecorder
from kvfsm.checking.world import ConnectorWorld
from kvfsm.invariants import check_all
from kvfsm.machines import MachineSet
from kvfsm.states import RequestState


class InvariantViolation(AssertionError):
    """A run broke a rule of the spec: a named invariant, an illegal or hidden transition (`trace`), or drain.

    `found` maps each broken invariant's name to its violations, one readable line each."""

    def __init__(self, step: int, found: Mapping[str, Sequence[str]]) -> None:
        self.step = step
        self.found = {name: list(lines) for name, lines in found.items()}
        lines = [f"{name}: {line}" for name, found_lines in self.found.items() for line in found_lines]
        super().__init__(f"step {step}: {', '.join(self.found)} violated\n  " + "\n  ".join(lines))

    @property
    def names(self) -> list[str]:
        return list(self.found)


class RunChecks:
    """Traces the machines from construction on; `after_step` raises `error` (an `InvariantViolation`) when a rule
    does not hold. Build it before the first step, so that the trace sees every transition."""

    def __init__(self, world: ConnectorWorld, machines: MachineSet,
                 error: type[InvariantViolation] = InvariantViolation) -> None:
        world.scheduler.ledger.keep_history = True  # ended jobs stay visible: no-convoy and failure-visible read them
        self.world = world
        self.trace = TraceRecorder(machines)
        self.error = error

    def violations(self) -> dict[str, list[str]]:
        """Every rule that does not hold now, by name."""
        found = check_all(self.world)
        if drift := self.trace.check():
            found["trace"] = drift
        if self.world.idle:
            unreleased = [f"request {r.req_id} is {r.state}, not released"
                          for r in self.world.requests.values() if r.state != RequestState.RELEASED]
            if unreleased:
                found["drained"] = found.get("drained", []) + unreleased
        return found

    def after_step(self, step: int) -> None:
        if found := self.violations():
            raise self.error(step, found)

    def close(self) -> None:
        """Stop tracing (the machines may outlive this run)."""
        self.trace.close()
