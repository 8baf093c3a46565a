"""The scheduler benchmark counts what it claims to, and its scan trace tells LRU from ARC."""

from __future__ import annotations

from collections import Counter

import pytest

from kvfsm.bindings import default_spec
from kvfsm.bench.scheduler import run, scan_comparison
from kvfsm.machines import MachineSet


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_benchmark_counts_every_transition_the_machine_fired(policy: str) -> None:
    fired: Counter[str] = Counter()
    observer = lambda lifecycle, _model, _source, trigger, _dest: fired.update([trigger])  # noqa: E731
    machines = MachineSet(default_spec())
    machines.observe(observer)
    result = run(policy, steps=6, requests=16, num_slots=512, documents=32, machines=machines)  # type: ignore[arg-type]
    assert result["transitions"] == sum(fired.values())
    assert fired["evict"] and fired["pin"] and fired["store-done"], f"the workload skipped a path: {fired}"


def test_a_scan_flushes_lru_but_not_arc_hot_blocks() -> None:
    lru = scan_comparison("lru", num_slots=64, hot=32, rounds=6)
    arc = scan_comparison("arc", num_slots=64, hot=32, rounds=6)  # cold, then learning, then hits
    assert lru["hot_hit_rate"] == 0.0 and arc["hot_hit_rate"] > 0.5
