"""Every declared transition is reachable by a shortest trace of the spec graph, and both machines take it."""

from __future__ import annotations

import pytest

from kvfsm.bindings import default_spec
from kvfsm.machines import MachineSet
from kvfsm.testing.coverage import Probe, declared_edges, guards_choosing, probe_registry, shortest_paths

SPEC = default_spec()


@pytest.mark.parametrize("backend", ["table", "transitions"])
@pytest.mark.parametrize("lifecycle", sorted(SPEC.lifecycles))
def test_shortest_trace_to_every_declared_transition_replays(lifecycle: str, backend: str) -> None:
    lc = SPEC[lifecycle]
    machine = MachineSet(SPEC, probe_registry(SPEC), backend=backend)[lifecycle]  # type: ignore[arg-type]
    paths = shortest_paths(lc)
    declared = {e for e in declared_edges(SPEC) if e[0] == lifecycle}
    assert set(paths) == declared, f"unreachable: {sorted(declared - set(paths))}"
    for edge, path in paths.items():
        probe = Probe(lc.initial)
        for step in path:
            probe.guard_values = guards_choosing(lc, step)
            assert machine.fire(probe, step[2]) == step[3], (edge, step)


def test_a_transition_out_of_an_unreachable_state_has_no_trace() -> None:
    """The control: a spec edited in memory to strand a state leaves its transitions without a trace."""
    lc = SPEC["cpu-block"]
    stranded = lc.model_copy(update={"transitions": tuple(t for t in lc.transitions if t.dest != "orphaned")})
    orphaned_exits = {e for e in declared_edges(SPEC) if e[0] == "cpu-block" and e[1] == "orphaned"}
    assert orphaned_exits and not orphaned_exits & set(shortest_paths(stranded))
