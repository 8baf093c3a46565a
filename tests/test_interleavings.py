"""Generated interleavings: kvfsm passes them all; each mutant is caught by some interleaving."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvfsm.machines import default_machines
from kvfsm.testing.interleavings import EXTERNAL, STEP_DRIVEN, interleavings_for
from kvfsm.testing.mutants import MUTANTS


def test_every_spec_trigger_has_a_driver() -> None:
    spec = default_machines().spec
    triggers = {(name, t) for name, lc in spec.lifecycles.items() for t in lc.triggers}
    assert triggers - STEP_DRIVEN - set(EXTERNAL) == set(), "a spec trigger no rule or engine step provokes"
    assert (STEP_DRIVEN | set(EXTERNAL)) - triggers == set(), "a driver for a trigger the spec no longer has"


def test_kvfsm_passes_generated_interleavings() -> None:
    run_state_machine_as_test(interleavings_for(None))


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_is_caught(mutant: str) -> None:
    machine = interleavings_for(mutant)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=settings(settings(), max_examples=400, print_blob=False))
    print(f"{mutant}: caught after {machine.examples} examples")
