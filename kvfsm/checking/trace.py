"""Trace conformance: every transition a run took is an edge of the spec, and no state changed behind its back.

The machines only fire legal transitions, so the interesting failure is code that assigns a `state` directly (or
copies a record and moves the copy): the recorder sees a transition whose source is not where the object was left.
"""

from __future__ import annotations

from typing import Any

from kvfsm.machines import MachineSet
from kvfsm.spec import Spec

Edge = tuple[str, str, str, str]  # lifecycle, source, trigger, dest


class TraceRecorder:
    def __init__(self, machines: MachineSet) -> None:
        self.machines = machines
        self.spec: Spec = machines.spec
        self.edges: set[Edge] = set()
        self.violations: list[str] = []
        self._last: dict[int, tuple[str, Any, str]] = {}  # id(model) -> (lifecycle, model, last dest)
        machines.observe(self)

    def __call__(self, lifecycle: str, model: Any, source: str, trigger: str, dest: str) -> None:
        self.edges.add((lifecycle, source, trigger, dest))
        previous = self._last.get(id(model))
        initial = self.spec[lifecycle].initial
        if previous is None and source != initial:
            self.violations.append(f"{lifecycle} {model!r} first seen leaving {source!r}, not {initial!r}")
        elif previous is not None and previous[2] != source:
            self.violations.append(f"{lifecycle} {model!r} left {source!r} but the machine left it in {previous[2]!r}")
        if not any(b.dest == dest for b in self.spec[lifecycle].branches(source, trigger)):
            self.violations.append(f"{lifecycle}: {source} --{trigger}--> {dest} is not an edge of the spec")
        self._last[id(model)] = (lifecycle, model, dest)

    def check(self) -> list[str]:
        """Recorded violations, plus any object whose state differs from where its last transition left it."""
        drift = [
            f"{lifecycle} {model!r} is {model.state!r}, but its last transition left it {dest!r}"
            for lifecycle, model, dest in self._last.values()
            if model.state != dest
        ]
        return self.violations + drift

    def close(self) -> None:
        self.machines.unobserve(self)
