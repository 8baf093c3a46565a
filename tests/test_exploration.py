"""Exhaustive search over every schedule of small workloads: kvfsm is clean everywhere, each mutant is caught."""

from __future__ import annotations

import pytest

from kvfsm.testing.explorer import EXPLORER_UNREACHABLE, SMALL_WORKLOADS, TIER_WORKLOADS, explore, fits
from kvfsm.testing.mutants import MUTANTS

WORKLOADS = {**SMALL_WORKLOADS, **TIER_WORKLOADS}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_schedule_of_a_small_workload_keeps_the_spec(name: str) -> None:
    result = explore(WORKLOADS[name])
    print(f"\n{name}: {result.states} states, {result.schedules_completed} complete schedules, none violating")
    assert result.clean, (result.violation, result.counterexample)
    assert result.exhausted, "the state budget cut the search short"


@pytest.mark.parametrize("mutant", sorted(set(MUTANTS) - set(EXPLORER_UNREACHABLE)))
def test_exhaustive_search_catches_mutant(mutant: str) -> None:
    caught = {}
    for name, workload in (TIER_WORKLOADS if MUTANTS[mutant].tier == "disk" else SMALL_WORKLOADS).items():
        if not fits(workload, mutant):
            continue
        result = explore(workload, mutant)
        if not result.clean:
            caught[name] = (result.states, result.violation[0])
    print(f"\n{mutant}: {caught}")
    assert caught, f"{mutant} survived every schedule of every small workload"


def test_mutants_the_explorer_cannot_show_are_tier_mutants_left_to_the_interleavings() -> None:
    assert all(MUTANTS[name].tier for name in EXPLORER_UNREACHABLE)
