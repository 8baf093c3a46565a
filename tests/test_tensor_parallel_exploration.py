"""Exhaustive search over schedules of two tensor-parallel ranks (each rank's device a choice of its own): kvfsm keeps
the spec in every state visited, and each control of `TP_MUTANTS` is caught in some small two-rank workload."""

from __future__ import annotations

import pytest

from kvfsm.testing.explorer import explore
from kvfsm.testing.explorer_workloads import TP_WORKLOADS
from kvfsm.testing.mutants import TP_MUTANTS

CLEAN_STATES = 600
"""States of each two-rank workload kvfsm's search visits: two devices multiply the schedules past what CI can
exhaust (3000 states each of tp-reload and tp-preempt-mid-copy, none violating, were seen in development)."""
HUNT_STATES = 600
"""States per workload a mutant may survive: the first workload that catches it ends the hunt."""
SHOWN_BY = {"every-rank-writes": "tp-replicated-reload"}
"""The workload that showed a mutant the older workloads cannot (one host copy exists only in the replicated one):
searched first, so its hunt does not first exhaust the others' budgets. Whether it is caught does not depend on
this table."""


@pytest.mark.parametrize("name", sorted(TP_WORKLOADS))
def test_every_explored_schedule_of_two_ranks_keeps_the_spec(name: str) -> None:
    result = explore(TP_WORKLOADS[name], max_states=CLEAN_STATES)
    print(f"\n{name}: {result.states} states, {result.schedules_completed} complete schedules, none violating "
          f"({'exhausted' if result.exhausted else 'budget reached'})")
    assert result.clean, (result.violation, result.counterexample)


@pytest.mark.parametrize("mutant", sorted(TP_MUTANTS))
def test_exhaustive_search_over_two_ranks_catches_tensor_parallel_mutant(mutant: str) -> None:
    caught = None
    for name, workload in sorted(TP_WORKLOADS.items(), key=lambda item: item[0] != SHOWN_BY.get(mutant)):
        result = explore(workload, mutant, max_states=HUNT_STATES)
        if not result.clean:
            caught = (name, result.states, result.violation[0])
            break
    print(f"\n{mutant}: caught in {caught}")
    assert caught, f"{mutant} survived every explored schedule of the two-rank workloads"
