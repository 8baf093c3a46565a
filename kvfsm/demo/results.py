"""What the demo's two runs did, and the verdict on them.

`RunReport` is filled by one run (`kvfsm.demo.runs`); `DemoResult` pairs the run without offloading with the run
with kvfsm and decides whether integrity held. The table (`kvfsm.demo.table`) and the exit status
(`kvfsm.demo.cli`) read only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfsm.connector.stats import ConnectorStats
from kvfsm.connector.tier_planner import TierStats
from kvfsm.demo.config import DemoConfig
from kvfsm.engine.oracle import poisoned

EXAMPLES_KEPT = 3
"""Violation lines kept per invariant for the report."""


@dataclass
class RunReport:
    """What one run did; `stats` and `violations` exist only for the run with kvfsm."""

    device: str
    outputs: dict[int, list[int]]
    steps: int
    wall_s: float
    """Serving time, without the time spent checking invariants (`check_s`)."""
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    computed_tokens: int
    preemptions: int
    stats: ConnectorStats | None = None
    tier_stats: TierStats | None = None
    check_s: float = 0.0
    violations: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def record(self, found: dict[str, list[str]]) -> None:
        for name, lines in found.items():
            self.violations[name] = self.violations.get(name, 0) + len(lines)
            kept = self.examples.setdefault(name, [])
            kept.extend(lines[:EXAMPLES_KEPT - len(kept)])


@dataclass(frozen=True)
class DemoResult:
    config: DemoConfig
    requests: int
    minimum_compute: int
    baseline: RunReport
    offloaded: RunReport

    @property
    def outputs_identical(self) -> bool:
        return len(self.baseline.outputs) == self.requests and self.offloaded.outputs == self.baseline.outputs

    @property
    def poisoned(self) -> list[int]:
        return sorted(set(poisoned(self.baseline.outputs)) | set(poisoned(self.offloaded.outputs)))

    @property
    def ok(self) -> bool:
        return self.outputs_identical and not self.offloaded.violations and not self.poisoned
